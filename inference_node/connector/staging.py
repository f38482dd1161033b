"""Staging: brings the KV of a load's chunks into the node cache, fetching misses from the memory service.

A fetch is one streaming `FetchKv` call for all of a load's misses, each asked for by its full key (content id
included); each blob is checked (checksum, key, token ids) and decoded on the host into a pinned buffer, then
copied to the device on a dedicated copy stream, so a fetch on the async path overlaps the engine's compute.
Device tensors made on the copy stream are recorded on the compute stream so that the allocator never reuses them
under a kernel still reading them. Under tensor parallelism each rank's stager keeps only its KV heads
(`KvHeadShard`): it copies to its device, and caches, that slice alone. The blob over the wire holds every head.
A synchronous load never fetches (`may_fetch=False`): a chunk missing from the node cache fails it at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_node.connector.node_cache import CachedKv, NodeKvCache
from inference_node.connector.tensor_parallel import UNSHARDED, KvHeadShard
from inference_node.plan import ChunkLoad
from inference_node.settings import NodeSettings
from inferscale_kv.blob import CorruptKvBlob, decode_kv_blob
from inferscale_kv.shape import KvShape


class NotResident(LookupError):
    """A synchronous load found a chunk missing from the node cache (it is recomputed, never fetched inline)."""


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

    def stage(self, user_id: str, chunks: Sequence[ChunkLoad], device: torch.device, dtype: torch.dtype,
              compute_stream: torch.cuda.Stream | None, may_fetch: bool) -> StagedChunks:
        """Every chunk's KV (this rank's heads) on `device` in `dtype`; raises (NotResident, LookupError,
        CorruptKvBlob, grpc.RpcError, ...) if any chunk cannot be had. Thread-safe: the async path calls it from a
        fetch thread."""
        entries = {chunk.key: self.cache.get(chunk.key, chunk.token_ids) for chunk in chunks}
        missing = [chunk for chunk in chunks if entries[chunk.key] is None]
        if missing and not may_fetch:
            raise NotResident(f"{len(missing)} chunks are not in the node cache (first: {missing[0].key})")
        if missing:
            fetched = ([self._synthetic(chunk, device, dtype) for chunk in missing] if self.settings.synthetic_kv
                       else self._fetch(user_id, missing, device, dtype, compute_stream))
            for chunk, entry in zip(missing, fetched, strict=True):
                self.cache.put(chunk.key, entry)
                entries[chunk.key] = entry
        return StagedChunks([entries[chunk.key] for chunk in chunks], len(chunks), len(chunks) - len(missing))

    def _fetch(self, user_id: str, missing: list[ChunkLoad], device: torch.device, dtype: torch.dtype,
               compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        from inferscale.v1 import memory_pb2 as pb

        header = next((chunk for chunk in missing if chunk.key.is_header), None)
        facts = [chunk for chunk in missing if not chunk.key.is_header]
        request = pb.FetchKvRequest(
            profile_id=missing[0].key.profile_id, user_id=user_id, include_header=header is not None,
            header_content_id=header.key.content_id if header else "",
            facts=[pb.FactRef(fact_id=c.key.fact_id, version=c.key.version, content_id=c.key.content_id)
                   for c in facts])
        replies = list(self._memory_stub().FetchKv(request, timeout=self.settings.fetch_timeout_s))
        ordered = ([header] if header else []) + facts
        if len(replies) != len(ordered):
            raise LookupError(f"memory service sent {len(replies)} KV entries for {len(ordered)} requested")
        host = {}
        for chunk, reply in zip(ordered, replies):
            if not reply.blob:
                raise LookupError(f"memory service has no KV for {chunk.key}")
            kv = decode_kv_blob(reply.blob, dtype)
            if kv.header.key != chunk.key or kv.header.token_ids != chunk.token_ids:
                raise CorruptKvBlob(f"{chunk.key}: the memory service sent KV of another key or other tokens")
            host[chunk.key] = (kv.keys[:, :, self._heads], kv.values[:, :, self._heads], kv.header.token_ids)
        in_order = [host[chunk.key] for chunk in missing]
        if device.type != "cuda":
            return [CachedKv(k.to(device).contiguous(), v.to(device).contiguous(), t) for k, v, t in in_order]
        return self._to_device(in_order, device, compute_stream)

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

    def _synthetic(self, chunk: ChunkLoad, device: torch.device, dtype: torch.dtype) -> CachedKv:
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
