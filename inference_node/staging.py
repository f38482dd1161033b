"""Staging: brings the KV of a load's chunks into the node cache, fetching misses from the memory service.

A fetch is one streaming `FetchKv` call for all of a load's misses; each blob is checked (checksum, token ids)
and decoded on the host into a pinned buffer, then copied to the device on a dedicated copy stream, so a fetch
that runs on the async path overlaps the engine's compute. Device tensors made on the copy stream are recorded
on the compute stream so that the allocator never reuses them under a kernel still reading them. Under tensor
parallelism each rank's stager keeps only its KV heads (`KvHeadShard`): it copies to its device, and caches, that
slice alone. The blob over the wire still holds every head.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_node.node_cache import CachedKv, NodeKvCache
from inference_node.settings import HEADER_CHUNK, NodeSettings
from inference_node.tensor_parallel import UNSHARDED, KvHeadShard
from inferscale_kv.blob import CorruptKvBlob, decode_kv_blob
from inferscale_kv.shape import KvShape
from memory_service.kv_tiers import KvKey

HEADER_USER = "_profile"


@dataclass(frozen=True)
class ChunkRef:
    """A chunk to stage: the header or a fact, with the token ids the prompt holds for it."""

    fact_id: str
    version: int
    token_ids: tuple[int, ...]


def chunk_key(profile_id: str, user_id: str, chunk: ChunkRef) -> KvKey:
    """The node-cache key: the header is shared by every user of a profile; facts are per user and version."""
    if chunk.fact_id == HEADER_CHUNK:
        return KvKey(profile_id, HEADER_USER, HEADER_CHUNK, 1)
    return KvKey(profile_id, user_id, chunk.fact_id, chunk.version)


@dataclass(frozen=True)
class StagedChunks:
    entries: list[CachedKv]  # in chunk order
    lookups: int
    hits: int


class KvStager:
    def __init__(self, settings: NodeSettings, cache: NodeKvCache, hf_config,
                 shard: KvHeadShard = UNSHARDED) -> None:
        self.settings = settings
        self.cache = cache
        model_shape = KvShape.from_config(hf_config)
        self._heads = shard.heads(model_shape.num_kv_heads)
        self._rank_shape = shard.of(model_shape)
        self._stub = None
        self._stub_lock = threading.Lock()
        self._copy_stream: torch.cuda.Stream | None = None

    def stage(self, profile_id: str, user_id: str, chunks: Sequence[ChunkRef], device: torch.device,
              dtype: torch.dtype, compute_stream: torch.cuda.Stream | None) -> StagedChunks:
        """Every chunk's KV (this rank's heads) on `device` in `dtype`; raises (LookupError, CorruptKvBlob,
        grpc.RpcError, ...) if any chunk cannot be had. Thread-safe: the async path calls it from a fetch thread."""
        keys = [chunk_key(profile_id, user_id, chunk) for chunk in chunks]
        entries = {key: self.cache.get(key) for key in keys}
        missing = [(key, chunk) for key, chunk in zip(keys, chunks) if entries[key] is None]
        protected = set(keys)
        if missing and self.settings.synthetic_kv:
            for key, chunk in missing:
                entries[key] = self._synthetic(chunk, device, dtype)
                self.cache.put(key, entries[key], protected=protected)
        elif missing:
            for (key, chunk), entry in zip(missing, self._fetch(profile_id, user_id, missing, device, dtype,
                                                                compute_stream)):
                self.cache.put(key, entry, protected=protected)
                entries[key] = entry
        return StagedChunks([entries[key] for key in keys], len(keys), len(keys) - len(missing))

    def _fetch(self, profile_id: str, user_id: str, missing: list[tuple[KvKey, ChunkRef]], device: torch.device,
               dtype: torch.dtype, compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        from inferscale.v1 import memory_pb2 as pb

        request = pb.FetchKvRequest(
            profile_id=profile_id, user_id=user_id,
            include_header=any(chunk.fact_id == HEADER_CHUNK for _, chunk in missing),
            facts=[pb.FactRef(fact_id=c.fact_id, version=c.version) for _, c in missing if c.fact_id != HEADER_CHUNK])
        replies = list(self._memory_stub().FetchKv(request, timeout=self.settings.fetch_timeout_s))
        if len(replies) != len(missing):
            raise LookupError(f"memory service sent {len(replies)} KV entries for {len(missing)} requested")
        host = []
        for (key, chunk), reply in zip(missing, replies):
            if not reply.blob:
                raise LookupError(f"memory service has no KV for {key}")
            kv = decode_kv_blob(reply.blob, dtype)
            if kv.header.token_ids != chunk.token_ids:
                raise CorruptKvBlob(f"{key}: stored token ids differ from the prompt's")
            host.append((kv.keys[:, :, self._heads], kv.values[:, :, self._heads], kv.header.token_ids))
        if device.type != "cuda":
            return [CachedKv(k.to(device).contiguous(), v.to(device).contiguous(), t) for k, v, t in host]
        return self._to_device(host, device, compute_stream)

    def _to_device(self, host, device: torch.device, compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        staged = []
        with torch.cuda.stream(self._copy_stream):
            for keys, values, token_ids in host:
                pair = []
                for tensor in (keys, values):
                    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                    pinned.copy_(tensor)
                    on_device = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    on_device.copy_(pinned, non_blocking=True)
                    if compute_stream is not None:
                        on_device.record_stream(compute_stream)
                    pair.append(on_device)
                staged.append(CachedKv(pair[0], pair[1], token_ids))
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()  # blocks only this thread: the compute stream keeps running
        return staged

    def _synthetic(self, chunk: ChunkRef, device: torch.device, dtype: torch.dtype) -> CachedKv:
        shape = self._rank_shape.of(len(chunk.token_ids))
        return CachedKv(torch.randn(shape, device=device, dtype=dtype) * 0.1,
                        torch.randn(shape, device=device, dtype=dtype) * 0.1, chunk.token_ids)

    def _memory_stub(self):
        with self._stub_lock:
            if self._stub is None:
                from inferscale.v1 import memory_pb2_grpc
                from inferscale_kv.call_credentials import NODE, memory_service_channel

                channel = memory_service_channel(self.settings.memory_service, NODE,
                                                 options=[("grpc.max_receive_message_length", 256 << 20)])
                self._stub = memory_pb2_grpc.MemoryServiceStub(channel)
            return self._stub
