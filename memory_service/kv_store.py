"""The service's fact KV store: tiers (GPU, pinned host, disk) in front of a durable index and work queue."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from memory_service.kv_index import KvIndex
from memory_service.kv_tiers import AdmitAll, AdmitBelowFraction, DiskTier, KvKey, KvTier, LruEviction, MemoryTier

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class KvStoreBudgets:
    gpu_bytes: int = 0
    host_bytes: int = 1 << 30
    disk_bytes: int = 100 << 30


class TieredKvStore:
    """Looks blobs up from the fastest tier down, promotes hits into the faster tiers, writes through to disk
    (the durable tier) first. A blob that fails its checksum on disk is dropped and its fact re-queued."""

    def __init__(self, root: Path, budgets: KvStoreBudgets, max_attempts: int = 3) -> None:
        self.index = KvIndex(root / "index.sqlite", max_attempts=max_attempts)
        cuda = torch.cuda.is_available()
        self.disk = DiskTier(root / "blobs", budgets.disk_bytes, LruEviction(), AdmitAll())
        self.disk.on_evict = self.index.forget_entry
        self.disk.on_corrupt = self._requeue_corrupt
        memory_tiers: list[KvTier] = []
        if cuda and budgets.gpu_bytes:
            memory_tiers.append(MemoryTier("gpu", budgets.gpu_bytes, LruEviction(), AdmitBelowFraction(0.1), "cuda"))
        if budgets.host_bytes:
            memory_tiers.append(MemoryTier("host", budgets.host_bytes, LruEviction(), AdmitBelowFraction(0.1), "cpu",
                                           pinned=cuda))
        self.tiers: list[KvTier] = [*memory_tiers, self.disk]
        self.corrupt_blobs = 0
        self._lock = threading.RLock()

    def _requeue_corrupt(self, key: KvKey) -> None:
        self.corrupt_blobs += 1
        log.warning("kv_blob_corrupt", profile_id=key.profile_id, user_id=key.user_id, fact_id=key.fact_id,
                    version=key.version)
        self.index.forget_entry(key)
        self.index.enqueue([key.profile_id], [(key.user_id, key.fact_id, key.version)])

    def put(self, key: KvKey, blob: bytes, token_ids: Sequence[int]) -> None:
        """Stores durably, then in the memory tiers that admit it, then marks it stored in the index."""
        with self._lock:
            if not self.disk.put(key, blob):
                raise OSError(f"disk tier refused {len(blob)} bytes (budget {self.disk.budget_bytes})")
            for tier in self.tiers[:-1]:
                tier.put(key, blob)
        self.index.record_stored(key, token_ids, len(blob))

    def get(self, key: KvKey) -> bytes | None:
        with self._lock:
            for depth, tier in enumerate(self.tiers):
                blob = tier.get(key)
                if blob is not None:
                    for faster in self.tiers[:depth]:
                        faster.put(key, blob)
                    return blob
        return None

    def promote(self, key: KvKey) -> None:
        """Brings an entry into the memory tiers; a no-op (no read, no copy) when one of them holds it already."""
        if not any(tier.contains(key) for tier in self.tiers[:-1]):
            self.get(key)

    def remove(self, keys: Iterable[KvKey]) -> None:
        with self._lock:
            for key in keys:
                for tier in self.tiers:
                    tier.remove(key)

    def reconcile(self) -> None:
        """Makes index and disk agree after a crash: files without an entry go, entries without a file go."""
        with self._lock:
            entries = set(self.index.all_entry_keys())
            on_disk = set(self.disk.keys())
            for orphan in on_disk - entries:
                self.disk.remove(orphan)
            for missing in entries - on_disk:
                self.index.forget_entry(missing)
        if on_disk ^ entries:
            log.info("kv_reconciled", orphan_files=len(on_disk - entries), missing_files=len(entries - on_disk))

    def close(self) -> None:
        self.index.close()
