"""Node-cache residency: the node's side of a load, over its two tiers (node_cache.py). A synchronous load reads its
chunks from the device tier alone (`resident`, engine thread: a missing chunk is a defect), where the step's
promotions (`promote`, engine thread) have copied the host-tier chunks it needs. A prefetch brings the
chunks the device tier lacks (`fetch`, fetch threads only): from the host tier, by one asynchronous host-to-device
copy on a copy stream, or, on a host-tier miss, from the worker's KV source (kv_source.py: the memory service, or
synthetic KV in speed runs), checked against this rank's KV shape and the model dtype before it enters either tier.
Chunks the directory reserved host room for stay in the host tier (pinned on CUDA), so a later device eviction leaves
them one copy away.

Device tensors made on the copy stream are recorded on the compute stream, so the allocator never reuses them under
a kernel still reading them; the fetch thread, not the engine thread, waits for the copy.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from inference_node.connector.kv_source import KvSource
from inference_node.connector.node_cache import NodeKvCache
from inference_node.kv_fetch import CachedKv
from inference_node.plan import ChunkLoad
from inferscale_kv.kv_key import KvKey
from inferscale_kv.shape import KvShape


class NotResident(LookupError):
    """A synchronous load found a chunk missing from the device tier (a defect: it is never fetched inline)."""


@dataclass(frozen=True)
class FetchCounts:
    """What one prefetch moved on one rank, per tier it came from (bytes of this rank's heads, wall seconds)."""

    from_host: int = 0
    host_bytes: int = 0
    host_seconds: float = 0.0
    from_source: int = 0
    source_bytes: int = 0
    source_seconds: float = 0.0


class KvResidency:
    """Which of a load's chunks are resident in this rank's device tier, and bringing the missing ones into it."""

    def __init__(self, device_tier: NodeKvCache, host_tier: NodeKvCache, source: KvSource,
                 rank_shape: KvShape) -> None:
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.rank_shape = rank_shape
        self._fetch = source.fetch
        self._copy_stream: torch.cuda.Stream | None = None

    def resident(self, chunks: Sequence[ChunkLoad]) -> list[CachedKv]:
        """Every chunk's entry, in chunk order; NotResident if the device tier lacks one (or holds other tokens)."""
        entries = [self.device_tier.get(chunk.key, chunk.token_ids) for chunk in chunks]
        missing = [chunk for chunk, entry in zip(chunks, entries, strict=True) if entry is None]
        if missing:
            raise NotResident(f"{len(missing)} chunks are not in the node cache (first: {missing[0].key})")
        return [entry for entry in entries if entry is not None]

    def promote(self, chunks: Sequence[ChunkLoad], device: torch.device) -> tuple[int, int]:
        """Copies `chunks` from the host tier into the device tier on the current stream (engine thread, before the
        step's loads, which read them in stream order; from pinned memory the copy is a DMA the thread does not wait
        for). One the host tier lacks is left out: the load that needs it fails (a defect). Returns the chunks and
        bytes copied."""
        copied = num_bytes = 0
        for chunk in chunks:
            entry = self.host_tier.get(chunk.key, chunk.token_ids)
            if entry is None or self.device_tier.get(chunk.key, chunk.token_ids) is not None:
                continue
            self.device_tier.put(chunk.key, CachedKv(entry.keys.to(device, non_blocking=True),
                                                     entry.values.to(device, non_blocking=True), entry.token_ids))
            copied += 1
            num_bytes += entry.nbytes
        return copied, num_bytes

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], device: torch.device, dtype: torch.dtype,
              compute_stream: torch.cuda.Stream | None, keep_on_host: Collection[KvKey] = (),
              to_device: bool = True, user_token: str = "") -> FetchCounts:
        """Puts every chunk the device tier lacks into it (this rank's heads, on `device` in `dtype`), all or none,
        taking each from the host tier when it holds it and from the KV source otherwise; those of `keep_on_host`
        fetched from the source also stay in the host tier. With `to_device` False, only brings the chunks of
        `keep_on_host` the host tier lacks into it (a warm-up). Raises what the source raises, or ValueError for an
        entry of another shape or dtype. Thread-safe: fetch threads call it."""
        if to_device:
            wanted = [chunk for chunk in chunks if self.device_tier.get(chunk.key, chunk.token_ids) is None]
        else:
            wanted = [chunk for chunk in chunks if chunk.key in keep_on_host]
        on_host = {chunk.key: entry for chunk in wanted
                   if (entry := self.host_tier.get(chunk.key, chunk.token_ids)) is not None}
        from_source = [chunk for chunk in wanted if chunk.key not in on_host]
        copied_at = time.perf_counter()
        copied = self._to_device(list(on_host.values()), device, compute_stream) if to_device else []
        host_seconds = time.perf_counter() - copied_at
        started = time.perf_counter()
        fetched = self._fetch(user_id, from_source, dtype, user_token=user_token) if from_source else []
        if len(fetched) != len(from_source):
            raise ValueError(f"the KV source gave {len(fetched)} entries for {len(from_source)} chunks")
        for chunk, entry in zip(from_source, fetched, strict=True):
            expected = self.rank_shape.of(len(chunk.token_ids))
            if (tuple(entry.keys.shape) != expected or tuple(entry.values.shape) != expected
                    or entry.keys.dtype != dtype or entry.values.dtype != dtype or entry.token_ids != chunk.token_ids):
                raise ValueError(f"{chunk.key}: fetched KV {tuple(entry.keys.shape)} {entry.keys.dtype} for "
                                 f"{len(entry.token_ids)} token ids; this rank needs {expected} {dtype} for the "
                                 f"chunk's {len(chunk.token_ids)}")
        kept = {chunk.key: _for_host_tier(entry, pinned=device.type == "cuda")
                for chunk, entry in zip(from_source, fetched, strict=True) if chunk.key in keep_on_host}
        sourced = [kept.get(chunk.key, entry) for chunk, entry in zip(from_source, fetched, strict=True)]
        if to_device:
            copied += self._to_device(sourced, device, compute_stream)
        source_seconds = time.perf_counter() - started
        for key, entry in kept.items():
            self.host_tier.put(key, entry)
        if to_device:
            host_chunks = [chunk for chunk in wanted if chunk.key in on_host]  # the order they were copied in
            for chunk, entry in zip([*host_chunks, *from_source], copied, strict=True):
                self.device_tier.put(chunk.key, entry)
        return FetchCounts(
            from_host=len(on_host) if to_device else 0,
            host_bytes=sum(entry.nbytes for entry in on_host.values()) if to_device else 0,
            host_seconds=host_seconds, from_source=len(from_source),
            source_bytes=sum(entry.nbytes for entry in fetched), source_seconds=source_seconds)

    def _to_device(self, entries: list[CachedKv], device: torch.device,
                   compute_stream: torch.cuda.Stream | None) -> list[CachedKv]:
        if device.type != "cuda":
            return [CachedKv(entry.keys.to(device), entry.values.to(device), entry.token_ids) for entry in entries]
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        copied = []
        with torch.cuda.stream(self._copy_stream):
            for entry in entries:
                pair = []
                for tensor in (entry.keys, entry.values):
                    on_device = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    on_device.copy_(tensor, non_blocking=True)
                    if compute_stream is not None:
                        on_device.record_stream(compute_stream)
                    pair.append(on_device)
                copied.append(CachedKv(pair[0], pair[1], entry.token_ids))
            done = torch.cuda.Event(blocking=True)  # the thread sleeps on it rather than spin
            done.record(self._copy_stream)
        done.synchronize()  # blocks only this thread: the compute stream keeps running
        return copied


def _for_host_tier(entry: CachedKv, pinned: bool) -> CachedKv:
    """The entry as the host tier keeps it: its own compact storage (a view would keep its whole base alive), and
    page-locked where the device is a GPU (one DMA copy away from it)."""
    keys, values = (_compact(tensor) for tensor in (entry.keys, entry.values))
    if pinned:
        keys = keys if keys.is_pinned() else keys.pin_memory()
        values = values if values.is_pinned() else values.pin_memory()
    return CachedKv(keys, values, entry.token_ids)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
