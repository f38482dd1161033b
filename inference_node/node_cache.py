"""The node's device-resident cache of decoded fact KV (pre-RoPE keys, values), LRU within a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from memory_service.kv_tiers import KvKey, LruEviction


@dataclass(frozen=True)
class CachedKv:
    keys: torch.Tensor  # [layers, tokens, kv_heads, head_dim], pre-RoPE, on the node's device
    values: torch.Tensor
    token_ids: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2


class NodeKvCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: dict[KvKey, CachedKv] = {}
        self._eviction = LruEviction()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.lookups = 0
        self.evictions = 0

    def get(self, key: KvKey) -> CachedKv | None:
        with self._lock:
            self.lookups += 1
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                self._eviction.record_access(key)
            return entry

    def put(self, key: KvKey, entry: CachedKv, protected: set[KvKey]) -> None:
        """Caches an entry, evicting least recently used ones (never those in `protected`)."""
        with self._lock:
            if key in self._entries or entry.nbytes > self.budget_bytes:
                return
            overflow = self._bytes + entry.nbytes - self.budget_bytes
            if overflow > 0:
                for victim in self._eviction.victims(overflow, protected):
                    self._bytes -= self._entries.pop(victim).nbytes
                    self._eviction.record_remove(victim)
                    self.evictions += 1
            self._entries[key] = entry
            self._eviction.record_insert(key, entry.nbytes)
            self._bytes += entry.nbytes

    @property
    def bytes_used(self) -> int:
        return self._bytes


class ResidencyHint:
    """The scheduler's guess of what the workers' node caches hold: the chunks it sent to be loaded lately, LRU
    within the same byte budget. A hint only: a wrong "resident" costs a synchronous fetch, a wrong "absent" an
    asynchronous one; neither changes what is loaded."""

    def __init__(self, budget_bytes: int, bytes_per_token: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = max(1, bytes_per_token)
        self._sizes: OrderedDict[KvKey, int] = OrderedDict()
        self._bytes = 0

    def __contains__(self, key: KvKey) -> bool:
        return key in self._sizes

    def record(self, key: KvKey, num_tokens: int) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return
        size = num_tokens * self.bytes_per_token
        self._sizes[key] = size
        self._bytes += size
        while self._bytes > self.budget_bytes and self._sizes:
            _, evicted = self._sizes.popitem(last=False)
            self._bytes -= evicted
