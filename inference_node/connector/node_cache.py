"""The node cache of decoded fact KV (pre-RoPE keys, values on the device), in two halves:

- `NodeCacheDirectory` (scheduler role) decides what the cache holds, within its byte budget: an entry becomes
  resident only once every rank reported its prefetch fetched, it is reserved while being fetched, and it leaves
  only by the directory's eviction (sent to the workers with the step's metadata), never while a request holds it.
  A load is declared only when every chunk is resident, so it never waits on the network.
- `NodeKvCache` (worker role, one per rank) holds the entries; it never evicts on its own, and every lookup checks
  the entry's token ids against the chunk's.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from inference_node.connector.metadata import PrefetchReport, PrefetchSpec
from inference_node.kv_fetch import CachedKv
from inference_node.plan import ChunkLoad
from inferscale_kv.kv_key import KvKey

_MAX_FAILURES_KEPT = 65_536  # failed fetches remembered (recently_failed)


class NodeKvCache:
    """One rank's entries. Thread-safe: fetch threads put while the engine thread reads and removes."""

    def __init__(self) -> None:
        self._entries: dict[KvKey, CachedKv] = {}
        self._lock = threading.Lock()
        self._bytes = 0

    def get(self, key: KvKey, token_ids: tuple[int, ...]) -> CachedKv | None:
        """The entry of `key` if it holds exactly `token_ids`' KV, else None."""
        with self._lock:
            entry = self._entries.get(key)
        return entry if entry is not None and entry.token_ids == token_ids else None

    def put(self, key: KvKey, entry: CachedKv) -> None:
        with self._lock:
            previous = self._entries.get(key)
            if previous is not None and previous.token_ids == entry.token_ids:
                return
            if previous is not None:
                self._bytes -= previous.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes

    def remove(self, keys: Iterable[KvKey]) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._bytes -= entry.nbytes

    def __contains__(self, key: KvKey) -> bool:
        with self._lock:
            return key in self._entries

    @property
    def bytes_used(self) -> int:
        return self._bytes


@dataclass(frozen=True)
class _Resident:
    num_bytes: int
    token_ids: tuple[int, ...]


@dataclass
class _Fetch:
    """A prefetch in flight: reserved bytes, the token ids it was ordered with, and the ranks settled so far."""

    num_bytes: int
    token_ids: tuple[int, ...]
    ordered_at: float
    deadline: float
    fetch_id: int
    fetched: int = 0
    failed: int = 0

    def settled(self, fetched: int, failed: int, ranks: int) -> bool:
        self.fetched += fetched
        self.failed += failed
        return self.fetched + self.failed >= ranks


class _Tier:
    """One tier's book (per rank): resident keys least recently used first, keys being fetched into it (reserved:
    their bytes count, they cannot be evicted), and the evictions not yet sent to the workers."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.resident: OrderedDict[KvKey, _Resident] = OrderedDict()
        self.reserved: dict[KvKey, _Resident] = {}
        self.bytes = 0
        self.evictions: list[KvKey] = []

    def holds(self, chunk: ChunkLoad) -> bool:
        entry = self.resident.get(chunk.key)
        return entry is not None and entry.token_ids == chunk.token_ids

    def known_tokens(self, key: KvKey) -> tuple[int, ...] | None:
        known = self.resident.get(key) or self.reserved.get(key)
        return known.token_ids if known is not None else None

    def victims(self, num_bytes: int, keep: Collection[KvKey]) -> list[KvKey] | None:
        """The least recently used resident keys outside `keep` to evict for `num_bytes` more, or None if even
        evicting all of them leaves too little room."""
        overflow = self.bytes + num_bytes - self.budget_bytes
        victims = []
        for key, entry in self.resident.items():
            if overflow <= 0:
                break
            if key not in keep:
                victims.append(key)
                overflow -= entry.num_bytes
        return victims if overflow <= 0 else None

    def coldest(self, num_bytes: int, eligible: Collection[KvKey]) -> list[KvKey] | None:
        """The least recently used resident keys, all of `eligible`, to evict for `num_bytes` more (stopping at the
        first key that is not), or None if they leave too little room."""
        overflow = self.bytes + num_bytes - self.budget_bytes
        victims = []
        for key, entry in self.resident.items():
            if overflow <= 0 or key not in eligible:
                break
            victims.append(key)
            overflow -= entry.num_bytes
        return victims if overflow <= 0 else None

    def evict(self, keys: Iterable[KvKey]) -> None:
        for key in keys:
            entry = self.resident.pop(key, None)
            if entry is not None:
                self.bytes -= entry.num_bytes
                self.evictions.append(key)

    def reserve(self, key: KvKey, entry: _Resident) -> None:
        self.reserved[key] = entry
        self.bytes += entry.num_bytes

    def settle(self, key: KvKey, fetched: bool, coldest: bool = False) -> None:
        """A reservation ends: resident if every rank fetched it (the least recently used where `coldest`), else
        gone from every rank."""
        entry = self.reserved.pop(key, None)
        if entry is None:
            return
        if fetched:
            self.resident[key] = entry
            if coldest:
                self.resident.move_to_end(key, last=False)
        else:
            self.bytes -= entry.num_bytes
            self.evictions.append(key)

    def take_evictions(self) -> tuple[KvKey, ...]:
        evictions, self.evictions = tuple(self.evictions), []
        return evictions


class NodeCacheDirectory:
    """What every rank's node cache holds, in two tiers (scheduler role, one thread): the device tier (what loads
    read), LRU within `budget_bytes` per rank, and the host tier, LRU within `host_budget_bytes` per rank, where
    chunks fetched from the memory service stay when room was reserved for them, so that a device eviction leaves
    them one host-to-device copy away: a request needing them has them copied back in the step that admits it
    (`promote`).

    A chunk is resident in a tier once every one of the `ranks` reported its prefetch settled (`settle`); while being
    fetched it is reserved (its bytes count, it cannot be evicted); it leaves a tier only by this directory's eviction,
    and the device tier never while a request holds it (`hold`). A key is known with one token-id tuple at a time (the
    one its prefetch was ordered with). Evictions, promotions and prefetches are taken once per step into the connector
    metadata; workers apply a step's device evictions, then its promotions (so no host eviction of the step comes
    before the copy), then its host evictions, its loads and its prefetches. A warm-up (`warm`) brings
    chunks into the host tier only, into its free room.
    """

    def __init__(self, budget_bytes: int, bytes_per_token: int, ranks: int = 1, host_budget_bytes: int = 0,
                 host_pinned: bool = False) -> None:
        """`host_pinned`: the host tier's entries are pinned by PyTorch's caching host allocator, which rounds each
        allocation (an entry's keys, its values) up to a power of two: each entry is counted at that size. (The
        allocator also keeps freed blocks cached for reuse by blocks of their size: not counted.)"""
        self.bytes_per_token = max(1, bytes_per_token)
        self.ranks = ranks
        self._host_pinned = host_pinned
        self._device = _Tier(budget_bytes)
        self._host = _Tier(host_budget_bytes)
        self._fetching: dict[KvKey, _Fetch] = {}  # into the device tier (and the host tier where reserved there)
        self._failed_at: dict[KvKey, float] = {}  # when a fetch of the key last failed (see recently_failed)
        self._unused_warm: set[KvKey] = set()  # host-tier chunks a warm-up brought that no request used yet
        self._warming: dict[KvKey, _Fetch] = {}  # into the host tier only
        self._holds: Counter[KvKey] = Counter()
        self._prefetches: list[PrefetchSpec] = []
        self._promotions: list[ChunkLoad] = []
        self._fetch_ids = itertools.count()

    @property
    def budget_bytes(self) -> int:
        return self._device.budget_bytes

    @property
    def host_budget_bytes(self) -> int:
        return self._host.budget_bytes

    def is_resident(self, chunk: ChunkLoad) -> bool:
        """Every rank's device tier holds the chunk's key with the chunk's token ids."""
        return self._device.holds(chunk)

    def is_on_host(self, chunk: ChunkLoad) -> bool:
        """Every rank's host tier holds the chunk's key with the chunk's token ids."""
        return self._host.holds(chunk)

    def fetch_id(self, key: KvKey) -> int | None:
        """The id of the prefetch of `key` into the device tier in flight (every prefetch gets a new one), None if
        none is."""
        fetch = self._fetching.get(key)
        return fetch.fetch_id if fetch is not None else None

    def fetch_expired(self, key: KvKey, now: float) -> bool:
        fetch = self._fetching.get(key)
        return fetch is not None and now > fetch.deadline

    def recently_failed(self, key: KvKey, now: float, within_s: float) -> bool:
        """A fetch of `key` ordered within `within_s` before `now` failed: a fetch nobody waits for is not ordered
        again so soon (each would evict others' chunks for a chunk the memory service may not have yet)."""
        failed_at = self._failed_at.get(key)
        return failed_at is not None and now - failed_at < within_s

    def knows_other_tokens(self, chunk: ChunkLoad) -> bool:
        """The chunk's key is resident, being fetched or warming, in either tier, with other token ids (a fetch or a
        warm-up reserves its tier's room under the token ids it was ordered with)."""
        known = (self._device.known_tokens(chunk.key), self._host.known_tokens(chunk.key))
        return any(tokens is not None and tokens != chunk.token_ids for tokens in known)

    def hold(self, keys: Iterable[KvKey]) -> None:
        """A request needs these keys: none of them is evicted from the device tier until released."""
        self._holds.update(keys)

    def release(self, keys: Iterable[KvKey]) -> None:
        for key in keys:
            self._holds[key] -= 1
            if self._holds[key] <= 0:
                del self._holds[key]

    def touch(self, keys: Iterable[KvKey]) -> None:
        for key in keys:
            for tier in (self._device, self._host):
                if key in tier.resident:
                    tier.resident.move_to_end(key)

    @property
    def bytes_used(self) -> int:
        """Device-tier bytes per rank, resident and being fetched."""
        return self._device.bytes

    @property
    def host_bytes_used(self) -> int:
        """Host-tier bytes per rank, resident and being fetched, each entry at its pinned size (`host_bytes`)."""
        return self._host.bytes

    def bytes_to_bring(self, chunks: Sequence[ChunkLoad]) -> tuple[int, int]:
        """Per rank, the bytes of `chunks` missing from the device tier that the host tier holds, and those it does
        not (to come from the memory service)."""
        from_host = from_source = 0
        for chunk in {chunk.key: chunk for chunk in chunks}.values():
            if self._device.holds(chunk):
                continue
            size = len(chunk.token_ids) * self.bytes_per_token
            if self._host.holds(chunk):
                from_host += size
            else:
                from_source += size
        return from_host, from_source

    def prefetch(self, user_id: str, chunks: Sequence[ChunkLoad], now: float, wait_s: float,
                 user_token: str = "") -> bool:
        """Orders `chunks` (neither resident nor being fetched) fetched into every rank's device tier, evicting least
        recently used chunks that no request holds to make room; False, changing nothing, if they cannot fit. Those
        the host tier lacks stay in it too where it has room (evicting its least recently used chunks). The fetch
        expires `wait_s` after `now`; a rank that cannot start it within `wait_s` reports it failed."""
        unique = list({chunk.key: chunk for chunk in chunks}.values())
        sizes = [len(chunk.token_ids) * self.bytes_per_token for chunk in unique]
        victims = self._device.victims(sum(sizes), self._holds)
        if victims is None:
            return False
        self._evict_from_device(victims)
        from_host = [chunk.key for chunk in unique if self._host.holds(chunk)]
        self.touch(from_host)  # read from the host tier now
        self._unused_warm.difference_update(from_host)
        keep_on_host = []
        for chunk, size in zip(unique, sizes, strict=True):
            fetch = _Fetch(size, chunk.token_ids, now, now + wait_s, next(self._fetch_ids))
            self._fetching[chunk.key] = fetch
            self._device.reserve(chunk.key, _Resident(size, chunk.token_ids))
            if self._reserve_on_host(chunk, size):
                keep_on_host.append(chunk.key)
        self._prefetches.append(PrefetchSpec(user_id, tuple(unique), wait_s, frozenset(keep_on_host),
                                             user_token=user_token))
        return True

    def promote(self, chunks: Sequence[ChunkLoad]) -> bool:
        """Makes `chunks` (each in the host tier, neither in the device tier nor being fetched) resident in the device
        tier at once: every rank copies them from its host tier in this step, before its loads (`take_promotions`).
        Evicts least recently used device-tier chunks that no request holds to make room; False, changing nothing, if
        they cannot fit or one is not in the host tier alone."""
        unique = [chunk for chunk in {chunk.key: chunk for chunk in chunks}.values()
                  if self._host.holds(chunk) and self._device.known_tokens(chunk.key) is None
                  and chunk.key not in self._fetching]
        if len(unique) != len({chunk.key for chunk in chunks}):
            return False
        sizes = [len(chunk.token_ids) * self.bytes_per_token for chunk in unique]
        victims = self._device.victims(sum(sizes), self._holds)
        if victims is None:
            return False
        self._evict_from_device(victims)
        for chunk, size in zip(unique, sizes, strict=True):
            self._device.reserve(chunk.key, _Resident(size, chunk.token_ids))
            self._device.settle(chunk.key, fetched=True)
        self.touch(chunk.key for chunk in unique)
        self._unused_warm.difference_update(chunk.key for chunk in unique)
        self._promotions.extend(unique)
        return True

    def warm(self, user_id: str, chunks: Sequence[ChunkLoad], now: float, wait_s: float, user_token: str = "") -> int:
        """Orders those of `chunks` that neither tier holds nor anyone fetches brought into every rank's host tier
        only, as many as fit; returns how many were ordered. A warm-up takes free room or the room of warmed chunks
        no request used yet, never a chunk a request used; warmed chunks enter as the least recently used."""
        ordered = []
        for chunk in {chunk.key: chunk for chunk in chunks}.values():
            if (chunk.key in self._fetching or chunk.key in self._warming or self._device.holds(chunk)
                    or self._host.known_tokens(chunk.key) is not None):
                continue
            size = self.host_bytes(len(chunk.token_ids) * self.bytes_per_token)
            victims = self._host.coldest(size, self._unused_warm - self._fetching.keys())
            if victims is None:
                break
            self._host.evict(victims)
            self._unused_warm.difference_update(victims)
            self._host.reserve(chunk.key, _Resident(size, chunk.token_ids))
            self._warming[chunk.key] = _Fetch(size, chunk.token_ids, now, now + wait_s, next(self._fetch_ids))
            ordered.append(chunk)
        if ordered:
            self._prefetches.append(PrefetchSpec(user_id, tuple(ordered), wait_s,
                                                 frozenset(chunk.key for chunk in ordered), to_device=False,
                                                 user_token=user_token))
        return len(ordered)

    def host_bytes(self, size: int) -> int:
        """What an entry of `size` bytes (keys and values) takes of the host tier's budget."""
        if not self._host_pinned or size <= 0:
            return size
        return 2 * (1 << (-(-size // 2) - 1).bit_length())

    def _reserve_on_host(self, chunk: ChunkLoad, size: int) -> bool:
        size = self.host_bytes(size)
        if self._host.known_tokens(chunk.key) is not None:
            return False
        # A host-tier chunk a device fetch in flight copies from stays until that fetch settles.
        victims = self._host.victims(size, self._fetching.keys())
        if victims is None:
            return False
        self._host.evict(victims)
        self._unused_warm.difference_update(victims)
        self._host.reserve(chunk.key, _Resident(size, chunk.token_ids))
        return True

    def settle(self, report: PrefetchReport) -> None:
        """Counts the ranks' reports; once every rank settled a chunk it is resident, or, if any rank failed it,
        evicted from every rank (those that fetched it drop it)."""
        for key in {*report.fetched, *report.failed}:
            fetch = self._fetching.get(key)
            if fetch is None or not fetch.settled(report.fetched[key], report.failed[key], self.ranks):
                continue
            del self._fetching[key]
            self._device.settle(key, not fetch.failed)
            if key not in self._warming:
                self._host.settle(key, not fetch.failed)
            if fetch.failed:
                self._failed_at[key] = fetch.ordered_at
                if len(self._failed_at) > _MAX_FAILURES_KEPT:  # the oldest half: ordered first
                    for old in list(self._failed_at)[: _MAX_FAILURES_KEPT // 2]:
                        del self._failed_at[old]
            else:
                self._failed_at.pop(key, None)
        for key in {*report.warmed, *report.warm_failed}:
            fetch = self._warming.get(key)
            if fetch is None or not fetch.settled(report.warmed[key], report.warm_failed[key], self.ranks):
                continue
            del self._warming[key]
            self._host.settle(key, not fetch.failed, coldest=True)
            if not fetch.failed:
                self._unused_warm.add(key)
            else:
                self._failed_at[key] = fetch.ordered_at

    def drop(self, keys: Iterable[KvKey]) -> None:
        """A synchronous load of these chunks failed in a worker: no longer trusted, evicted from every rank's
        tiers."""
        keys = list(keys)
        self._evict_from_device(keys)
        self._host.evict(keys)
        self._unused_warm.difference_update(keys)

    def take_evictions(self) -> tuple[KvKey, ...]:
        return self._device.take_evictions()

    def take_host_evictions(self) -> tuple[KvKey, ...]:
        return self._host.take_evictions()

    def _evict_from_device(self, keys: Sequence[KvKey]) -> None:
        """Evicts `keys` from the device tier, and from this step's promotions not yet sent (a worker applies a
        step's evictions before its promotions, so one promoted and then evicted in one step would stay on it)."""
        self._device.evict(keys)
        if self._promotions:
            gone = set(keys)
            self._promotions = [chunk for chunk in self._promotions if chunk.key not in gone]

    def take_promotions(self) -> tuple[ChunkLoad, ...]:
        promotions, self._promotions = tuple(self._promotions), []
        return promotions

    def take_prefetches(self) -> list[PrefetchSpec]:
        prefetches, self._prefetches = self._prefetches, []
        return prefetches
