"""The service's fact KV store: tiers (GPU, pinned host, and the durable one: a directory or an object store) in front
of the coordination store's KV index and work queue."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import structlog
import torch

from inferscale_kv.eviction import LruEviction
from inferscale_kv.kv_key import KvKey
from memory_service.coordination.kv_index import KvIndex
from memory_service.coordination.users import UserRecords
from memory_service.coordination.work_queue import KvWorkQueue
from memory_service.kv_tiers import AdmitBelowFraction, DurableTier, KvTier, MemoryTier

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class KvStoreBudgets:
    gpu_bytes: int = 0
    host_bytes: int = 1 << 30
    disk_bytes: int = 100 << 30  # the durable tier's, when it is a directory (an object store is unbounded)


class TieredKvStore:
    """Looks blobs up from the fastest tier down, promotes hits into the faster tiers, writes through to the durable
    tier (a directory, or an object store that replicas share) first. A blob that fails its checksum there is
    dropped and its fact re-queued.

    The index and the tiers change together: what the index lists is what the tiers may serve (`get` serves nothing
    else), a completion is recorded only under its lease and cannot land after the delete of its fact (no orphan
    blobs), and the profiles' memory header KV is pinned in every tier it enters (every node needs it; it is never
    evicted). Within one process one lock orders these steps; across replicas the coordination store's transactions
    do (a completion records after its upload, a delete removes what it un-recorded).
    """

    def __init__(self, kv_index: KvIndex, work_queue: KvWorkQueue, user_records: UserRecords, durable: DurableTier,
                 budgets: KvStoreBudgets, shared: bool) -> None:
        """`shared`: other replicas write the same coordination database and durable tier."""
        self.kv_index = kv_index
        self.work_queue = work_queue
        self._user_records = user_records
        self.shared = shared
        cuda = torch.cuda.is_available()
        self.durable = durable
        self.durable.on_evict = self._forget_evicted
        self.durable.on_corrupt = self._requeue_corrupt
        memory_tiers: list[KvTier] = []
        if cuda and budgets.gpu_bytes:
            memory_tiers.append(MemoryTier("gpu", budgets.gpu_bytes, LruEviction(), AdmitBelowFraction(0.1), "cuda"))
        if budgets.host_bytes:
            memory_tiers.append(MemoryTier("host", budgets.host_bytes, LruEviction(), AdmitBelowFraction(0.1), "cpu",
                                           pinned=cuda))
        self.memory_tiers = memory_tiers
        self.tiers: list[KvTier] = [*memory_tiers, self.durable]
        if not shared:
            for key in self.durable.keys():  # noqa: SIM118 - a tier, not a dict
                if key.is_header:
                    self.durable.pin(key)
        self.corrupt_blobs = 0
        self._lock = threading.RLock()
        self._swept_generations: dict[str, int] = {}

    def _forget_evicted(self, key: KvKey) -> None:
        """The durable copy is gone: the index stops listing it and no memory tier keeps an unservable copy."""
        self.kv_index.forget_entry(key)
        for tier in self.memory_tiers:
            tier.remove(key)

    def _requeue_corrupt(self, key: KvKey) -> None:
        self.corrupt_blobs += 1
        log.warning("kv_blob_corrupt", profile_id=key.profile_id, user_id=key.user_id, fact_id=key.fact_id,
                    version=key.version)
        self.kv_index.forget_entry(key)
        if not key.is_header:  # a lost header is asked of the next worker that leases (header_kv_wanted)
            self.work_queue.enqueue([key.profile_id], [(key.user_id, key.fact_id, key.version)])

    def _put_in(self, tier: KvTier, key: KvKey, blob: bytes) -> bool:
        return tier.put(key, blob, pinned=key.is_header)

    def put(self, key: KvKey, blob: bytes, token_ids: Sequence[int], lease_id: str | None) -> bool:
        """Stores durably and records it in the index, then fills the memory tiers that admit it. With a
        `lease_id` only while that lease still holds the job for key's version; False if not, and then no tier
        is touched (a late or repeated completion never disturbs what is stored). A key the index lists already
        names these bytes: its file is not rewritten."""
        with self._lock:
            if lease_id is not None and not self.work_queue.lease_holds(key, lease_id):
                return False
            listed = self._is_listed(key)
            if not listed and not self._put_in(self.durable, key, blob):
                raise OSError(f"{self.durable.name} tier refused {len(blob)} bytes "
                              f"(budget {self.durable.budget_bytes})")
            if not self.kv_index.record_stored(key, token_ids, len(blob), lease_id):
                if not listed and not self._is_listed(key):  # another replica may have recorded it meanwhile
                    self.durable.remove(key)
                return False
            for tier in self.memory_tiers:
                self._put_in(tier, key, blob)
        return True

    def _is_listed(self, key: KvKey) -> bool:
        entry = self.kv_index.entry(key.profile_id, key.user_id, key.fact_id)
        return entry is not None and entry.key == key

    def get(self, key: KvKey) -> bytes | None:
        """The blob stored under exactly `key`, if the index lists it."""
        with self._lock:
            if not self._is_listed(key):
                return None
            for depth, tier in enumerate(self.tiers):
                blob = tier.get(key)
                if blob is not None:
                    for faster in self.tiers[:depth]:
                        self._put_in(faster, key, blob)
                    return blob
            if self._is_listed(key):  # listed, yet no tier holds it (lost from the durable tier): computed again
                self._requeue_corrupt(key)
        return None

    def promote(self, key: KvKey) -> None:
        """Brings an entry into the memory tiers; a no-op (no read, no copy) when one of them holds it already."""
        if not any(tier.contains(key) for tier in self.memory_tiers):
            self.get(key)

    def forget(self, user_id: str, fact_ids: Sequence[str] | None) -> list[KvKey]:
        """Drops the facts' KV (all of the user's when None) from the index and every tier, and their jobs."""
        with self._lock:
            dropped = self.kv_index.forget_facts(user_id, fact_ids)
            self._remove(dropped)
        if dropped and self.shared:
            self._user_records.invalidate(user_id)  # other replicas' sweeps look at the user again, after the forget
        return dropped

    def forget_entries(self, keys: Iterable[KvKey]) -> None:
        with self._lock:
            for key in keys:
                self.kv_index.forget_entry(key)
            self._remove(keys)

    def _remove(self, keys: Iterable[KvKey]) -> None:
        for key in keys:
            for tier in self.tiers:
                tier.remove(key)

    def _memory_tier_keys(self) -> list[KvKey]:
        return [key for tier in self.memory_tiers for key in tier.keys()]  # noqa: SIM118 - tiers, not dicts

    def sweep_memory_tiers(self) -> int:
        """Drops the memory tiers' copies of keys the index no longer lists, for the users whose write generation
        moved since the last sweep (another replica deleted their facts); returns the copies dropped."""
        users = {key.user_id for key in self._memory_tier_keys()}
        generations = self._user_records.write_generations(sorted(users))
        moved = [user for user, generation in generations.items() if generation != self._swept_generations.get(user)]
        dropped = 0
        for user in moved:
            self._swept_generations[user] = generations[user]
            with self._lock:
                stale = [key for key in self._memory_tier_keys() if key.user_id == user and not self._is_listed(key)]
                for key in stale:
                    for tier in self.memory_tiers:
                        dropped += tier.remove(key)
        return dropped

    def reconcile(self) -> None:
        """Makes the index and the durable tier agree after a crash: blobs without an entry go, entries without a
        blob go. Local stores only: replicas sharing an object store never list it (another replica's upload may not
        be recorded yet)."""
        if self.shared:
            return
        with self._lock:
            entries = set(self.kv_index.all_entry_keys())
            on_disk = set(self.durable.keys())
            for orphan in on_disk - entries:
                self.durable.remove(orphan)
            for missing in entries - on_disk:
                self.kv_index.forget_entry(missing)
        if on_disk ^ entries:
            log.info("kv_reconciled", orphan_files=len(on_disk - entries), missing_files=len(entries - on_disk))
