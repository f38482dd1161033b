"""The service's fact KV store: the durable tier (a directory or an object store) that holds every blob, a host-memory
cache in front of it for the blobs nodes fetch, and the coordination store's KV index and work queue beside them."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import structlog

from inferscale_kv.eviction import LruEviction
from inferscale_kv.kv_key import KvKey
from memory_service.coordination.audits import QuarantinedBlob
from memory_service.coordination.kv_index import KvIndex
from memory_service.coordination.users import UserRecords
from memory_service.coordination.work_queue import KvWorkQueue
from memory_service.kv_tiers import AdmitBelowFraction, KvTier, MemoryTier

log = structlog.get_logger(__name__)

HOST_CACHE = "host"


@dataclass(frozen=True)
class KvStoreBudgets:
    host_bytes: int = 1 << 30  # the host-memory cache of fetched blobs (0: none)
    disk_bytes: int = 100 << 30  # the durable tier's, when it is a directory (an object store is unbounded)


class TieredKvStore:
    """Where fact KV lives and how it reaches a node.

    - A worker's upload (`put`) is written to the durable tier and recorded in the index, in that order, under its
      lease; nothing else moves: KV travels toward a node only when that node fetches it.
    - A node's fetch (`get`, key by key) serves only what the index lists under exactly the key asked for, checked
      just before each read. A read is served from the host cache, else from the durable tier (checksum and key
      checked there, once per read from storage), and then kept in the host cache (LRU within its budget; the
      profiles' header KV pinned), so each byte is read from storage at most once per miss; concurrent misses of one
      key share one read. Reads take no store-wide lock and run in parallel.
    - What the index lists and what the tiers hold change together under one lock (puts, forgets, a blob found
      corrupt or lost), so that a completion cannot land after the delete of its fact (no orphan blobs), and a blob
      forgotten while it was being read is not cached afterwards: a forget removes the durable copy first, then the
      cached one, and marks the key if a read of it is in flight (that read then returns without caching). Across
      replicas the coordination store's transactions order these steps (a completion records after its upload, a
      delete removes what it un-recorded), and the host cache's copies of KV another replica deleted are swept.
    """

    def __init__(self, kv_index: KvIndex, work_queue: KvWorkQueue, user_records: UserRecords, durable: KvTier,
                 budgets: KvStoreBudgets, shared: bool) -> None:
        """`shared`: other replicas write the same coordination database and durable tier."""
        self.kv_index = kv_index
        self.work_queue = work_queue
        self._user_records = user_records
        self.shared = shared
        self.durable = durable
        self.durable.on_evict = self._forget_evicted
        self.durable.on_corrupt = self._requeue_corrupt
        self.host_cache = (MemoryTier(HOST_CACHE, budgets.host_bytes, LruEviction(), AdmitBelowFraction(0.1))
                           if budgets.host_bytes else None)
        self.tiers: list[KvTier] = [*([self.host_cache] if self.host_cache else []), self.durable]
        if not shared:
            for key in self.durable.keys():  # noqa: SIM118 - a tier, not a dict
                if key.is_header:
                    self.durable.pin(key)
        self.corrupt_blobs = 0  # failed their check when read
        self.lost_blobs = 0  # listed, but their durable copy was gone
        self.bytes_read = {tier.name: 0 for tier in self.tiers}  # read from each tier for fetches
        self.bytes_served = 0  # handed to fetches (a read shared by concurrent misses counts once above)
        self._lock = threading.RLock()  # orders changes of the index and the tiers
        self._cache_lock = threading.Lock()  # the host cache's admissions, the reads in flight and their marks
        self._reads: dict[KvKey, Future[bytes | None]] = {}  # durable reads in flight (at most one per key)
        self._forgotten_while_read: set[KvKey] = set()  # of those, the keys forgotten meanwhile: not cached
        self._cached_since_sweep: set[KvKey] = set()  # shared stores: the sweep looks at these whatever moved
        self._swept_generations: dict[str, int] = {}

    # ------------------------------------------------------------------ writes

    def put(self, key: KvKey, blob: bytes, token_ids: Sequence[int], lease_id: str | None, producer: str = "",
            audit: bool = False) -> bool:
        """Stores durably and records it in the index, with the worker that uploaded it (`producer`) and, with
        `audit`, an audit to come (KvIndex.record_stored). With a `lease_id` only while that lease still holds the
        job for key's version; False if not, and then nothing is touched (a late or repeated completion never
        disturbs what is stored). A key the index lists already names these bytes: its file is not rewritten."""
        with self._lock:
            if lease_id is not None and not self.work_queue.lease_holds(key, lease_id):
                return False
            listed = bool(self.listed([key]))
            if not listed and not self.durable.put(key, blob, pinned=key.is_header):
                raise OSError(f"{self.durable.name} tier refused {len(blob)} bytes "
                              f"(budget {self.durable.budget_bytes})")
            if not self.kv_index.record_stored(key, token_ids, len(blob), lease_id, producer, audit):
                if not listed and not self.listed([key]):  # another replica may have recorded it meanwhile
                    self.durable.remove(key)
                return False
        return True

    def forget(self, user_id: str, fact_ids: Sequence[str] | None) -> list[KvKey]:
        """Drops the facts' KV (all of the user's when None) from the index and every tier, and their jobs."""
        with self._lock:
            dropped = self.kv_index.forget_facts(user_id, fact_ids)
            self._remove(dropped)
        if dropped and self.shared:
            self._user_records.invalidate(user_id)  # other replicas' sweeps look at the user again, after the forget
        return dropped

    def quarantine(self, key: KvKey, exclude: Sequence[str], kept: Sequence[QuarantinedBlob]) -> bool:
        """Withdraws the entry stored under exactly `key` from service (KvIndex.quarantine: its blobs kept aside, the
        `exclude` workers barred, its fact queued again) and drops it from every tier; False if it was not listed."""
        with self._lock:
            if not self.kv_index.quarantine(key, exclude, kept):
                return False
            self._remove([key])
        if self.shared:
            self._user_records.invalidate(key.user_id)
        return True

    def forget_entries(self, keys: Iterable[KvKey]) -> None:
        with self._lock:
            keys = list(keys)
            for key in keys:
                self.kv_index.forget_entry(key)
            self._remove(keys)

    def _remove(self, keys: Sequence[KvKey]) -> None:
        """The durable copies first: a read that starts after this cannot find one to cache."""
        for key in keys:
            self.durable.remove(key)
        with self._cache_lock:
            for key in keys:
                if key in self._reads:
                    self._forgotten_while_read.add(key)
                if self.host_cache is not None:
                    self.host_cache.remove(key)

    def _forget_evicted(self, key: KvKey) -> None:
        """The durable copy is gone (evicted for space): the index stops listing it and the cache drops its copy."""
        with self._lock:
            self.kv_index.forget_entry(key)
            self._remove([key])

    def _requeue_corrupt(self, key: KvKey) -> None:
        """A blob failed its check when read: forgotten, and its fact computed again."""
        self._recompute(key, "kv_blob_corrupt")

    def _requeue_lost(self, key: KvKey) -> None:
        """A read found no durable copy: if the index still lists the key (checked under the lock, after any forget
        or eviction in progress has finished), the copy is lost and the fact computed again."""
        with self._lock:
            if self.listed([key]):
                self._recompute(key, "kv_blob_lost")

    def _recompute(self, key: KvKey, event: str) -> None:
        """Forgets a stored entry whose blob cannot be served and queues its fact again, if the index still listed
        it (a forget racing the read has then taken the fact away, and nothing is queued)."""
        with self._lock:
            if not self.kv_index.forget_entry(key):
                self._remove([key])
                return
            if event == "kv_blob_corrupt":
                self.corrupt_blobs += 1
            else:
                self.lost_blobs += 1
            log.warning(event, profile_id=key.profile_id, user_id=key.user_id, fact_id=key.fact_id,
                        version=key.version)
            self._remove([key])
            if not key.is_header:  # a lost header is asked of the next worker that leases (header_kv_wanted)
                self.work_queue.enqueue([key.profile_id], [(key.user_id, key.fact_id, key.version)])

    # ------------------------------------------------------------------ reads

    def listed(self, keys: Sequence[KvKey]) -> set[KvKey]:
        """Those of `keys` the index lists under exactly that key (one index query per profile and owner)."""
        by_owner: dict[tuple[str, str], list[KvKey]] = {}
        for key in keys:
            by_owner.setdefault((key.profile_id, key.user_id), []).append(key)
        found: set[KvKey] = set()
        for (profile_id, owner), owned in by_owner.items():
            entries = self.kv_index.entries(profile_id, owner, [key.fact_id for key in owned])
            found.update(key for key in owned if (entry := entries.get(key.fact_id)) and entry.key == key)
        return found

    def read(self, key: KvKey) -> bytes | None:
        """The blob of a key `listed` just returned: from the host cache, else from the durable tier (then cached);
        None if it is gone meanwhile (forgotten, or found corrupt or lost: then its fact is queued again)."""
        if self.host_cache is not None and (blob := self.host_cache.get(key)) is not None:
            self._count_read(self.host_cache, blob)
            return blob
        blob = self._read_durable(key)
        with self._cache_lock:
            self.bytes_served += len(blob or b"")
        return blob

    def _read_durable(self, key: KvKey) -> bytes | None:
        """The durable tier's copy, read once for every concurrent miss of the key, then cached."""
        with self._cache_lock:
            pending = self._reads.get(key)
            leader = pending is None
            if pending is None:
                pending = self._reads[key] = Future()
        if not leader:
            return pending.result()
        try:
            blob = self.durable.get(key)
            if blob is None:
                self._requeue_lost(key)
            else:
                self._count_read(self.durable, blob)
            pending.set_result(blob)
            return blob
        except BaseException as error:
            pending.set_exception(error)
            raise
        finally:
            with self._cache_lock:
                del self._reads[key]
                forgotten = key in self._forgotten_while_read
                self._forgotten_while_read.discard(key)
                if self.host_cache is not None and not forgotten and pending.done() and not pending.exception():
                    blob = pending.result()
                    if blob is not None and self.host_cache.put(key, blob, pinned=key.is_header) and self.shared:
                        self._cached_since_sweep.add(key)

    def get(self, key: KvKey) -> bytes | None:
        """The blob stored under exactly `key`, if the index lists it."""
        return self.read(key) if self.listed([key]) else None

    def _count_read(self, tier: KvTier, blob: bytes) -> None:
        with self._cache_lock:
            self.bytes_read[tier.name] += len(blob)
            if tier is self.host_cache:
                self.bytes_served += len(blob)

    # ------------------------------------------------------------------ maintenance

    def sweep_host_cache(self) -> int:
        """Drops the host cache's copies of keys the index no longer lists, among those of the users whose write
        generation moved since the last sweep (another replica deleted their facts) and those cached since the last
        sweep (a read that overlapped another replica's delete); returns the copies dropped. Such a copy is never
        served meanwhile (reads check the index first): the sweep frees its memory."""
        if self.host_cache is None:
            return 0
        with self._cache_lock:
            fresh, self._cached_since_sweep = self._cached_since_sweep, set()
        cached = list(self.host_cache.keys())
        users = sorted({key.user_id for key in cached})
        generations = self._user_records.write_generations(users)
        moved = {user for user, generation in generations.items() if generation != self._swept_generations.get(user)}
        self._swept_generations = generations  # only the users cached now
        candidates = [key for key in cached if key.user_id in moved or key in fresh]
        stale = set(candidates) - self.listed(candidates)
        with self._cache_lock:
            return sum(self.host_cache.remove(key) for key in stale)

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
