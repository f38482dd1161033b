"""The node cache of decoded fact KV (pre-RoPE keys, values on the device), in two halves:

- `NodeCacheDirectory` (scheduler role) decides what the cache holds, within its byte budget: an entry becomes
  resident only once a load that fetched it was reported finished and not failed, it is reserved while its fetch
  is in flight, and it leaves only by the directory's eviction (sent to the workers with the step's metadata).
  A synchronous load is planned only when every chunk is resident, so the engine step never waits on the network.
- `NodeKvCache` (worker role, one per rank) holds the entries; it never evicts on its own, and every lookup checks
  the entry's token ids against the chunk's.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

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


class NodeCacheDirectory:
    """What every rank's node cache holds, LRU within `budget_bytes` per rank (scheduler role, one thread)."""

    def __init__(self, budget_bytes: int, bytes_per_token: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = max(1, bytes_per_token)
        self._resident: OrderedDict[KvKey, int] = OrderedDict()
        self._reserved: dict[KvKey, int] = {}  # being fetched by in-flight loads: key -> bytes
        self._holders: Counter[KvKey] = Counter()  # chunks of in-flight loads (fetched or not): never evicted
        self._evictions: list[KvKey] = []

    def is_resident(self, key: KvKey) -> bool:
        return key in self._resident

    def touch(self, keys: Iterable[KvKey]) -> None:
        for key in keys:
            if key in self._resident:
                self._resident.move_to_end(key)

    @property
    def bytes_used(self) -> int:
        return sum(self._resident.values()) + sum(self._reserved.values())

    def start_fetch(self, chunks: Iterable[tuple[KvKey, int]], protected: set[KvKey]) -> None:
        """An async load is sent: its chunks are held until it settles, those not resident are reserved, and least
        recently used unheld entries (never `protected`: this step's loads read them) are evicted to make room."""
        for key, num_tokens in chunks:
            self._holders[key] += 1
            if key not in self._resident:
                self._reserved.setdefault(key, num_tokens * self.bytes_per_token)
        overflow = self.bytes_used - self.budget_bytes
        for key in list(self._resident):
            if overflow <= 0:
                break
            if key in protected or key in self._holders:
                continue
            overflow -= self._resident.pop(key)
            self._evictions.append(key)

    def settle(self, keys: Iterable[KvKey], loaded: bool) -> None:
        """An async load was reported finished: a successful one made its chunks resident; a failed one leaves
        none of its fetched chunks behind (unless another in-flight load still holds them)."""
        for key in keys:
            self._holders[key] -= 1
            if self._holders[key] <= 0:
                del self._holders[key]
            if key in self._resident:
                continue
            if loaded:
                self._resident[key] = self._reserved.pop(key, 0)
            elif key not in self._holders:
                self._reserved.pop(key, None)
                self._evictions.append(key)

    def drop(self, keys: Iterable[KvKey]) -> None:
        """A synchronous load of these chunks failed: no longer trusted as resident."""
        for key in keys:
            size = self._resident.pop(key, None)
            if size is None:
                continue
            if key in self._holders:  # an in-flight load reads it: it settles it again
                self._reserved.setdefault(key, size)
            else:
                self._evictions.append(key)

    def take_evictions(self) -> list[KvKey]:
        evictions, self._evictions = self._evictions, []
        return evictions
