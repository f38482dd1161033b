"""Staging: brings the KV of a load's chunks into the node cache, getting misses from the worker's KV source
(kv_source.py: the memory service, or synthetic KV in speed runs).

A synchronous load never fetches (`may_fetch=False`): a chunk missing from the node cache fails it at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_node.connector.kv_source import KvSource
from inference_node.connector.node_cache import CachedKv, NodeKvCache
from inference_node.plan import ChunkLoad


class NotResident(LookupError):
    """A synchronous load found a chunk missing from the node cache (it is recomputed, never fetched inline)."""


@dataclass(frozen=True)
class StagedChunks:
    entries: list[CachedKv]  # in chunk order
    lookups: int
    hits: int

    @property
    def misses(self) -> int:
        return self.lookups - self.hits


class KvStager:
    def __init__(self, cache: NodeKvCache, source: KvSource) -> None:
        self.cache = cache
        self._fetch = source.fetch

    def stage(self, user_id: str, chunks: Sequence[ChunkLoad], device: torch.device, dtype: torch.dtype,
              compute_stream: torch.cuda.Stream | None, may_fetch: bool) -> StagedChunks:
        """Every chunk's KV (this rank's heads) on `device` in `dtype`; raises (NotResident, or what the source
        raises) if any chunk cannot be had. Thread-safe: the async path calls it from a fetch thread."""
        cached = {chunk.key: self.cache.get(chunk.key, chunk.token_ids) for chunk in chunks}
        entries = {key: entry for key, entry in cached.items() if entry is not None}
        missing = [chunk for chunk in chunks if chunk.key not in entries]
        if missing and not may_fetch:
            raise NotResident(f"{len(missing)} chunks are not in the node cache (first: {missing[0].key})")
        if missing:
            fetched = self._fetch(user_id, missing, device, dtype, compute_stream)
            for chunk, entry in zip(missing, fetched, strict=True):
                self.cache.put(chunk.key, entry)
                entries[chunk.key] = entry
        return StagedChunks([entries[chunk.key] for chunk in chunks], len(chunks), len(chunks) - len(missing))
