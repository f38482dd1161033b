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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from inference_node.connector.metadata import PrefetchReport, PrefetchSpec
from inference_node.plan import ChunkLoad
from inferscale_kv.kv_key import KvKey


@dataclass(frozen=True)
class CachedKv:
    keys: torch.Tensor  # [layers, tokens, kv_heads, head_dim], pre-RoPE, on the node's device
    values: torch.Tensor
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape or self.keys.shape[1] != len(self.token_ids):
            raise ValueError(f"KV of shape {tuple(self.keys.shape)} / {tuple(self.values.shape)} for "
                             f"{len(self.token_ids)} token ids")

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


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
    deadline: float
    fetch_id: int
    fetched: int = 0
    failed: int = 0


class NodeCacheDirectory:
    """What every rank's node cache holds, LRU within `budget_bytes` per rank (scheduler role, one thread).

    A chunk is resident once every one of the `ranks` reported its prefetch fetched (`settle`); while being fetched
    it is reserved (its bytes count, it cannot be evicted); it leaves only by this directory's eviction, never while
    a request holds it (`hold`). A key is known with one token-id tuple at a time (the one its prefetch was ordered
    with). Evictions and prefetches are taken once per step into the connector metadata; workers apply a step's
    evictions before its loads and its loads before its prefetches.
    """

    def __init__(self, budget_bytes: int, bytes_per_token: int, ranks: int = 1) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = max(1, bytes_per_token)
        self.ranks = ranks
        self._resident: OrderedDict[KvKey, _Resident] = OrderedDict()  # least recently used first
        self._fetching: dict[KvKey, _Fetch] = {}
        self._holds: Counter[KvKey] = Counter()
        self._evictions: list[KvKey] = []
        self._prefetches: list[PrefetchSpec] = []
        self._bytes = 0  # resident and being fetched
        self._fetch_ids = itertools.count()

    def is_resident(self, chunk: ChunkLoad) -> bool:
        """Every rank holds the chunk's key with the chunk's token ids."""
        entry = self._resident.get(chunk.key)
        return entry is not None and entry.token_ids == chunk.token_ids

    def fetch_id(self, key: KvKey) -> int | None:
        """The id of the prefetch of `key` in flight (every prefetch gets a new one), None if none is."""
        fetch = self._fetching.get(key)
        return fetch.fetch_id if fetch is not None else None

    def fetch_expired(self, key: KvKey, now: float) -> bool:
        fetch = self._fetching.get(key)
        return fetch is not None and now > fetch.deadline

    def knows_other_tokens(self, chunk: ChunkLoad) -> bool:
        """The chunk's key is resident or being fetched with other token ids than the chunk's."""
        known = self._resident.get(chunk.key) or self._fetching.get(chunk.key)
        return known is not None and known.token_ids != chunk.token_ids

    def hold(self, keys: Iterable[KvKey]) -> None:
        """A request needs these keys: none of them is evicted until released."""
        self._holds.update(keys)

    def release(self, keys: Iterable[KvKey]) -> None:
        for key in keys:
            self._holds[key] -= 1
            if self._holds[key] <= 0:
                del self._holds[key]

    def touch(self, keys: Iterable[KvKey]) -> None:
        for key in keys:
            if key in self._resident:
                self._resident.move_to_end(key)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def prefetch(self, user_id: str, chunks: Sequence[ChunkLoad], now: float, wait_s: float) -> bool:
        """Orders `chunks` (neither resident nor being fetched) fetched into every rank's node cache, evicting least
        recently used chunks that no request holds to make room; False, changing nothing, if they cannot fit. The
        fetch expires `wait_s` after `now`; a rank that cannot start it within `wait_s` reports it failed."""
        unique = list({chunk.key: chunk for chunk in chunks}.values())
        sizes = [len(chunk.token_ids) * self.bytes_per_token for chunk in unique]
        overflow = self.bytes_used + sum(sizes) - self.budget_bytes
        victims = []
        for key, entry in self._resident.items():
            if overflow <= 0:
                break
            if key not in self._holds:
                victims.append(key)
                overflow -= entry.num_bytes
        if overflow > 0:
            return False
        for key in victims:
            self._bytes -= self._resident.pop(key).num_bytes
        self._evictions.extend(victims)
        for chunk, size in zip(unique, sizes, strict=True):
            self._fetching[chunk.key] = _Fetch(size, chunk.token_ids, now + wait_s, next(self._fetch_ids))
            self._bytes += size
        self._prefetches.append(PrefetchSpec(user_id, tuple(unique), wait_s))
        return True

    def settle(self, report: PrefetchReport) -> None:
        """Counts the ranks' reports; once every rank settled a chunk it is resident, or, if any rank failed it,
        evicted from every rank (those that fetched it drop it)."""
        for key in {*report.fetched, *report.failed}:
            fetch = self._fetching.get(key)
            if fetch is None:
                continue
            fetch.fetched += report.fetched[key]
            fetch.failed += report.failed[key]
            if fetch.fetched + fetch.failed < self.ranks:
                continue
            del self._fetching[key]
            if fetch.failed:
                self._bytes -= fetch.num_bytes
                self._evictions.append(key)
            else:
                self._resident[key] = _Resident(fetch.num_bytes, fetch.token_ids)

    def drop(self, keys: Iterable[KvKey]) -> None:
        """A synchronous load of these chunks failed in a worker: no longer trusted, evicted from every rank."""
        for key in keys:
            entry = self._resident.pop(key, None)
            if entry is not None:
                self._bytes -= entry.num_bytes
                self._evictions.append(key)

    def take_evictions(self) -> tuple[KvKey, ...]:
        evictions, self._evictions = tuple(self._evictions), []
        return evictions

    def take_prefetches(self) -> list[PrefetchSpec]:
        prefetches, self._prefetches = self._prefetches, []
        return prefetches
