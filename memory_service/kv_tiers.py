"""KV tiers: one small interface (contains, get, put, remove, pin) over the host-memory cache and the durable
tier (a directory here, or an object store: memory_service.object_store), with eviction and admission as separate
policies.

Tiers store opaque, checksummed KV blobs (inferscale_kv.blob) and are thread-safe: each keeps its accounting (sizes,
eviction order, stats) under a lock of its own, held for bookkeeping only, never across a file or network read or
write, so reads of one tier run in parallel.
"""

from __future__ import annotations

import os
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from inferscale_kv.blob import CorruptKvBlob, read_kv_header
from inferscale_kv.blob_names import BLOB_SUFFIX, blob_name, key_of_blob_name
from inferscale_kv.eviction import EvictionPolicy
from inferscale_kv.kv_key import KvKey


@dataclass
class TierStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    lookups: int = 0
    evictions: int = 0


class AdmissionPolicy(ABC):
    """Decides whether a blob may enter a tier at all."""

    @abstractmethod
    def admit(self, key: KvKey, size: int, budget_bytes: int) -> bool: ...


class AdmitAll(AdmissionPolicy):
    def admit(self, key: KvKey, size: int, budget_bytes: int) -> bool:
        return size <= budget_bytes


class AdmitBelowFraction(AdmissionPolicy):
    """Refuses blobs larger than a fraction of the budget, so one huge entry cannot flush a whole tier."""

    def __init__(self, max_fraction: float) -> None:
        self.max_fraction = max_fraction

    def admit(self, key: KvKey, size: int, budget_bytes: int) -> bool:
        return size <= self.max_fraction * budget_bytes


class KvTier(ABC):
    """A store of KV blobs with a byte budget. `get` counts a lookup, and a hit when found; a tier that checks what
    it reads drops a torn or corrupted blob and reports it through `on_corrupt` instead of returning it; a tier that
    evicts reports each evicted key through `on_evict`. Thread-safe."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        self.name = name
        self.budget_bytes = budget_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()  # the accounting's; never held across I/O
        self.on_evict: Callable[[KvKey], None] = lambda key: None
        self.on_corrupt: Callable[[KvKey], None] = lambda key: None

    @abstractmethod
    def contains(self, key: KvKey) -> bool: ...

    @abstractmethod
    def get(self, key: KvKey) -> bytes | None: ...

    @abstractmethod
    def put(self, key: KvKey, blob: bytes, *, pinned: bool = False) -> bool:
        """Stores the blob; `pinned`: never evicted. False, and nothing changed, when the tier refuses it."""

    @abstractmethod
    def remove(self, key: KvKey) -> bool: ...

    @abstractmethod
    def keys(self) -> Iterator[KvKey]: ...

    def pin(self, key: KvKey) -> bool:
        """Protects an entry from eviction; False if absent (a tier that never evicts pins nothing)."""
        return False

    def _count_lookup(self, hit: bool) -> None:
        with self._lock:
            self.stats.lookups += 1
            self.stats.hits += hit

    def _verified(self, key: KvKey, blob: bytes) -> bytes | None:
        """`blob` if its checksum holds and it names `key`; else the entry is dropped and reported corrupt."""
        try:
            if read_kv_header(blob).key != key:
                raise CorruptKvBlob("the blob names another key than its file or object")
        except CorruptKvBlob:
            self.remove(key)
            self.on_corrupt(key)
            return None
        return blob


class BudgetedTier(KvTier):
    """A tier that holds at most its budget: `put` may refuse (admission policy) and may evict (eviction policy);
    pinned entries are never evicted. A subclass stores bytes in two steps so that no I/O happens under the lock:
    `_prepare_write` (I/O, e.g. a temporary file written and synced) and `_commit_write` (under the lock and quick,
    e.g. the rename); `_read` runs without the lock."""

    def __init__(self, name: str, budget_bytes: int, eviction: EvictionPolicy, admission: AdmissionPolicy) -> None:
        super().__init__(name, budget_bytes)
        self.eviction = eviction
        self.admission = admission
        self._pinned: set[Hashable] = set()  # KvKeys, typed as the eviction policy takes them

    @abstractmethod
    def _read(self, key: KvKey) -> bytes | None:
        """The entry's bytes, or None; called without the lock (may do I/O)."""

    def _prepare_write(self, key: KvKey, blob: bytes) -> object:
        """What `_commit_write` needs to store the blob; called without the lock (may do I/O)."""
        return blob

    @abstractmethod
    def _commit_write(self, key: KvKey, prepared: object, size: int) -> None:
        """Makes the prepared write visible; called under the lock."""

    def _discard_write(self, prepared: object) -> None:
        """Undoes a prepared write that was not committed (refused: over budget, everything pinned)."""

    @abstractmethod
    def _delete(self, key: KvKey) -> int:
        """Removes the entry; returns the bytes freed (0 if absent). Called under the lock."""

    @abstractmethod
    def _size_of(self, key: KvKey) -> int: ...

    def get(self, key: KvKey) -> bytes | None:
        blob = self._read(key)
        with self._lock:
            self.stats.lookups += 1
            if blob is not None:
                self.stats.hits += 1
                self.eviction.record_access(key)
        return blob

    def put(self, key: KvKey, blob: bytes, *, pinned: bool = False) -> bool:
        """Stores the blob (evicting unpinned entries as needed); a pinned one bypasses the admission policy (it
        must still fit the budget)."""
        if len(blob) > self.budget_bytes or not (pinned or self.admission.admit(key, len(blob), self.budget_bytes)):
            return False
        prepared = self._prepare_write(key, blob)
        evicted: list[KvKey] = []
        with self._lock:
            self._remove_locked(key)
            overflow = self.stats.bytes + len(blob) - self.budget_bytes
            if overflow > 0:
                victims = cast(list[KvKey], self.eviction.victims(overflow, self._pinned))  # keys it was given
                if sum(self._size_of(victim) for victim in victims) < overflow:
                    self._discard_write(prepared)
                    return False
                for victim in victims:
                    self._remove_locked(victim)
                    self.stats.evictions += 1
                evicted = victims
            self._commit_write(key, prepared, len(blob))
            self.eviction.record_insert(key, len(blob))
            self.stats.entries += 1
            self.stats.bytes += len(blob)
            if pinned:
                self._pinned.add(key)
        for victim in evicted:
            self.on_evict(victim)
        return True

    def remove(self, key: KvKey) -> bool:
        with self._lock:
            return self._remove_locked(key)

    def _remove_locked(self, key: KvKey) -> bool:
        freed = self._delete(key)
        if not freed:
            return False
        self.eviction.record_remove(key)
        self._pinned.discard(key)
        self.stats.entries -= 1
        self.stats.bytes -= freed
        return True

    def pin(self, key: KvKey) -> bool:
        with self._lock:
            if not self.contains(key):
                return False
            self._pinned.add(key)
            return True


class MemoryTier(BudgetedTier):
    """Blobs as the immutable bytes objects they arrived in (host memory): a hit hands out the stored object itself,
    without a copy."""

    def __init__(self, name: str, budget_bytes: int, eviction: EvictionPolicy, admission: AdmissionPolicy) -> None:
        super().__init__(name, budget_bytes, eviction, admission)
        self._blobs: dict[KvKey, bytes] = {}

    def contains(self, key: KvKey) -> bool:
        return key in self._blobs

    def _read(self, key: KvKey) -> bytes | None:
        return self._blobs.get(key)

    def _commit_write(self, key: KvKey, prepared: object, size: int) -> None:
        self._blobs[key] = bytes(cast(bytes, prepared))  # bytes(b) of a bytes object is that object: no copy

    def _delete(self, key: KvKey) -> int:
        blob = self._blobs.pop(key, None)
        return 0 if blob is None else len(blob)

    def _size_of(self, key: KvKey) -> int:
        blob = self._blobs.get(key)
        return 0 if blob is None else len(blob)

    def keys(self) -> Iterator[KvKey]:
        return iter(list(self._blobs))


class DiskTier(BudgetedTier):
    """Durable tier in a local directory: one file per blob, written atomically (temporary file, fsync, rename), so a
    name always holds one whole blob; reads check each blob (checksum, key). Existing files are found again at start
    (oldest first in LRU order); files not named like blobs are removed."""

    def __init__(self, root: Path, budget_bytes: int, eviction: EvictionPolicy, admission: AdmissionPolicy) -> None:
        super().__init__("disk", budget_bytes, eviction, admission)
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._sizes: dict[KvKey, int] = {}
        self._restore()

    def path(self, key: KvKey) -> Path:
        return self.root / blob_name(key)

    def _restore(self) -> None:
        found: list[tuple[float, KvKey, int]] = []
        for path in self.root.glob(f"*/*/*{BLOB_SUFFIX}"):
            key = key_of_blob_name(path.relative_to(self.root).as_posix())
            if key is None:
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self.eviction.record_insert(key, size)
            self.stats.entries += 1
            self.stats.bytes += size
        for stray in self.root.glob("*/*/.tmp-*"):
            stray.unlink(missing_ok=True)

    def contains(self, key: KvKey) -> bool:
        return key in self._sizes

    def _read(self, key: KvKey) -> bytes | None:
        if key not in self._sizes:
            return None
        try:
            blob = self.path(key).read_bytes()
        except FileNotFoundError:
            if key not in self._sizes:  # removed while it was being read
                return None
            blob = b""  # listed, yet its file is gone: dropped and reported below
        except OSError:
            blob = b""
        return self._verified(key, blob)

    def _prepare_write(self, key: KvKey, blob: bytes) -> object:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp_name = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(handle, "wb") as temp_file:
                temp_file.write(blob)
                temp_file.flush()
                os.fsync(temp_file.fileno())
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        return temp_name

    def _commit_write(self, key: KvKey, prepared: object, size: int) -> None:
        os.replace(cast(str, prepared), self.path(key))
        self._sizes[key] = size

    def _discard_write(self, prepared: object) -> None:
        Path(cast(str, prepared)).unlink(missing_ok=True)

    def _delete(self, key: KvKey) -> int:
        size = self._sizes.pop(key, 0)
        if size:
            self.path(key).unlink(missing_ok=True)
        return size

    def _size_of(self, key: KvKey) -> int:
        return self._sizes.get(key, 0)

    def keys(self) -> Iterator[KvKey]:
        return iter(list(self._sizes))
