"""Where the worker role gets the fact KV its node cache misses, chosen once when the worker is built (`kv_source`):

- `MemoryServiceKv` (serving): one streaming `FetchKv` call for all of a prefetch's chunks, each asked for by its full
  key (content id included); each blob is checked (checksum, key, token ids) and decoded on the host into a pinned
  buffer, then copied to the device on a dedicated copy stream, so a prefetch on a fetch thread overlaps the engine's
  compute. Device tensors made on the copy stream are recorded on the compute stream so that the allocator never
  reuses them under a kernel still reading them. Under tensor parallelism each rank keeps only its KV heads
  (`KvHeadShard`): it copies to its device that slice alone. The blob over the wire holds every head.
- `SyntheticKv` (speed runs only, `NodeSettings.synthetic_kv`): random KV of the right shape, so the engine side can
  be measured without a memory service.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from inference_node.connector.node_cache import CachedKv
from inference_node.connector.tensor_parallel import UNSHARDED, KvHeadShard
from inference_node.plan import ChunkLoad
from inference_node.settings import NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import CorruptKvBlob, decode_kv_blob
from inferscale_kv.call_credentials import NODE, memory_service_channel
from inferscale_kv.kv_key import KvKey
from inferscale_kv.shape import KvShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HostKv = tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]  # keys, values (this rank's heads), token ids


class KvSource(Protocol):
    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], device: torch.device, dtype: torch.dtype,
              compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        """Every chunk's KV (this rank's heads) on `device` in `dtype`, in chunk order; raises (LookupError,
        CorruptKvBlob, grpc.RpcError, ...) if any chunk cannot be had. Thread-safe: fetch threads call it."""
        ...


def kv_source(settings: NodeSettings, hf_config: PretrainedConfig, shard: KvHeadShard = UNSHARDED) -> KvSource:
    """The source the node's settings ask for, holding `shard`'s heads of the model's KV."""
    model_shape = KvShape.from_config(hf_config)
    if settings.synthetic_kv:
        return SyntheticKv(shard.of(model_shape))
    return MemoryServiceKv(settings.memory_service, settings.fetch_timeout_s, shard.heads(model_shape.num_kv_heads))


class MemoryServiceKv:
    def __init__(self, address: str, timeout_s: float, heads: slice) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._heads = heads
        self._stub: memory_pb2_grpc.MemoryServiceStub | None = None
        self._stub_lock = threading.Lock()
        self._copy_stream: torch.cuda.Stream | None = None

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], device: torch.device, dtype: torch.dtype,
              compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        header = next((chunk for chunk in chunks if chunk.key.is_header), None)
        facts = [chunk for chunk in chunks if not chunk.key.is_header]
        request = pb.FetchKvRequest(
            profile_id=chunks[0].key.profile_id, user_id=user_id, include_header=header is not None,
            header_content_id=header.key.content_id if header else "",
            facts=[pb.FactRef(fact_id=c.key.fact_id, version=c.key.version, content_id=c.key.content_id)
                   for c in facts])
        replies = list(self._memory_stub().FetchKv(request, timeout=self.timeout_s))
        ordered = ([header] if header else []) + facts
        if len(replies) != len(ordered):
            raise LookupError(f"memory service sent {len(replies)} KV entries for {len(ordered)} requested")
        host: dict[KvKey, HostKv] = {}
        for chunk, reply in zip(ordered, replies, strict=True):
            if not reply.blob:
                raise LookupError(f"memory service has no KV for {chunk.key}")
            kv = decode_kv_blob(reply.blob, dtype)
            if kv.header.key != chunk.key or kv.header.token_ids != chunk.token_ids:
                raise CorruptKvBlob(f"{chunk.key}: the memory service sent KV of another key or other tokens")
            host[chunk.key] = (kv.keys[:, :, self._heads], kv.values[:, :, self._heads], kv.header.token_ids)
        in_order: list[HostKv] = [host[chunk.key] for chunk in chunks]
        if device.type != "cuda":
            return [CachedKv(k.to(device).contiguous(), v.to(device).contiguous(), t) for k, v, t in in_order]
        return self._to_device(in_order, device, compute_stream)

    def _to_device(self, host: list[HostKv], device: torch.device,
                   compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        copied = []
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
                copied.append(CachedKv(pair[0], pair[1], token_ids))
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()  # blocks only this thread: the compute stream keeps running
        return copied

    def _memory_stub(self) -> memory_pb2_grpc.MemoryServiceStub:
        with self._stub_lock:
            if self._stub is None:
                channel = memory_service_channel(self.address, NODE,
                                                 options=[("grpc.max_receive_message_length", 256 << 20)])
                self._stub = memory_pb2_grpc.MemoryServiceStub(channel)
            return self._stub


class SyntheticKv:
    def __init__(self, rank_shape: KvShape) -> None:
        self.rank_shape = rank_shape

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], device: torch.device, dtype: torch.dtype,
              compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        return [self._random(chunk, device, dtype) for chunk in chunks]

    def _random(self, chunk: ChunkLoad, device: torch.device, dtype: torch.dtype) -> CachedKv:
        shape = self.rank_shape.of(len(chunk.token_ids))
        return CachedKv(torch.randn(shape, device=device, dtype=dtype) * 0.1,
                        torch.randn(shape, device=device, dtype=dtype) * 0.1, chunk.token_ids)
