"""Node-cache residency: the node cache's side of a load. A synchronous load reads its chunks from the node cache alone
(`resident`, engine thread: a missing chunk is a defect); a prefetch brings the chunks the node cache lacks from the
worker's KV source (`fetch`, fetch threads only: kv_source.py, the memory service or synthetic KV in speed runs),
and checks each against this rank's KV shape and the model dtype before it enters the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_node.connector.kv_source import KvSource
from inference_node.connector.node_cache import CachedKv, NodeKvCache
from inference_node.plan import ChunkLoad
from inferscale_kv.shape import KvShape


class NotResident(LookupError):
    """A synchronous load found a chunk missing from the node cache (a defect: it is never fetched inline)."""


class KvResidency:
    """Which of a load's chunks are resident in this rank's node cache, and fetching the missing ones into it."""

    def __init__(self, cache: NodeKvCache, source: KvSource, rank_shape: KvShape) -> None:
        self.cache = cache
        self.rank_shape = rank_shape
        self._fetch = source.fetch

    def resident(self, chunks: Sequence[ChunkLoad]) -> list[CachedKv]:
        """Every chunk's entry, in chunk order; NotResident if the node cache lacks one (or holds other tokens)."""
        entries = [self.cache.get(chunk.key, chunk.token_ids) for chunk in chunks]
        missing = [chunk for chunk, entry in zip(chunks, entries, strict=True) if entry is None]
        if missing:
            raise NotResident(f"{len(missing)} chunks are not in the node cache (first: {missing[0].key})")
        return [entry for entry in entries if entry is not None]

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], device: torch.device, dtype: torch.dtype,
              compute_stream: torch.cuda.Stream | None) -> int:
        """Puts every chunk the node cache lacks into it (this rank's heads, on `device` in `dtype`), all or none;
        raises what the source raises, or ValueError for an entry of another shape or dtype. Returns how many were
        fetched. Thread-safe: fetch threads call it."""
        missing = [chunk for chunk in chunks if self.cache.get(chunk.key, chunk.token_ids) is None]
        if not missing:
            return 0
        fetched = self._fetch(user_id, missing, device, dtype, compute_stream)
        if len(fetched) != len(missing):
            raise ValueError(f"the KV source gave {len(fetched)} entries for {len(missing)} chunks")
        for chunk, entry in zip(missing, fetched, strict=True):
            expected = self.rank_shape.of(len(chunk.token_ids))
            if (tuple(entry.keys.shape) != expected or entry.keys.dtype != dtype or entry.values.dtype != dtype
                    or entry.keys.device != device or entry.token_ids != chunk.token_ids):
                raise ValueError(f"{chunk.key}: fetched KV {tuple(entry.keys.shape)} {entry.keys.dtype} on "
                                 f"{entry.keys.device} for {len(entry.token_ids)} token ids; this rank needs "
                                 f"{expected} {dtype} on {device} for the chunk's {len(chunk.token_ids)}")
        for chunk, entry in zip(missing, fetched, strict=True):
            self.cache.put(chunk.key, entry)
        return len(missing)
