"""Eviction policies over byte-budgeted entries, shared by the service's KV tiers and the node's cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable


class EvictionPolicy(ABC):
    """Chooses which entries leave a tier when it runs over its byte budget."""

    @abstractmethod
    def record_insert(self, key: Hashable, size: int) -> None: ...

    @abstractmethod
    def record_access(self, key: Hashable) -> None: ...

    @abstractmethod
    def record_remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def victims(self, bytes_to_free: int, pinned: set[Hashable]) -> list[Hashable]:
        """Unpinned entries whose removal frees at least `bytes_to_free` (fewer if impossible)."""


class LruEviction(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()

    def record_insert(self, key: Hashable, size: int) -> None:
        self._sizes[key] = size
        self._sizes.move_to_end(key)

    def record_access(self, key: Hashable) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def record_remove(self, key: Hashable) -> None:
        self._sizes.pop(key, None)

    def victims(self, bytes_to_free: int, pinned: set[Hashable]) -> list[Hashable]:
        chosen: list[Hashable] = []
        freed = 0
        for key, size in self._sizes.items():
            if freed >= bytes_to_free:
                break
            if key not in pinned:
                chosen.append(key)
                freed += size
        return chosen
