"""KV tiers: one small interface (contains, get, put, remove, pin/unpin) over GPU memory, host memory and the
durable tier (a directory here, or an object store: memory_service.object_store), with eviction and admission as
separate policies.

Tiers store opaque, checksummed KV blobs (inferscale_kv.blob). Tiers are not thread-safe on their own:
TieredKvStore serializes access.
"""

from __future__ import annotations

import os
import re
import tempfile
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from inferscale_kv.blob import CorruptKvBlob, read_kv_header
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
    """A byte-budgeted store of KV blobs. `put` may refuse (admission) and may evict (eviction policy);
    pinned entries are never evicted. `get` counts a lookup, and a hit when found."""

    def __init__(self, name: str, budget_bytes: int, eviction: EvictionPolicy, admission: AdmissionPolicy) -> None:
        self.name = name
        self.budget_bytes = budget_bytes
        self.eviction = eviction
        self.admission = admission
        self.stats = TierStats()
        self._pinned: set[Hashable] = set()  # KvKeys, typed as the eviction policy takes them
        self.on_evict: Callable[[KvKey], None] = lambda key: None

    @abstractmethod
    def contains(self, key: KvKey) -> bool: ...

    @abstractmethod
    def _read(self, key: KvKey) -> bytes | None: ...

    @abstractmethod
    def _write(self, key: KvKey, blob: bytes) -> None: ...

    @abstractmethod
    def _delete(self, key: KvKey) -> int:
        """Removes the entry; returns the bytes freed (0 if absent)."""

    @abstractmethod
    def keys(self) -> Iterator[KvKey]: ...

    def get(self, key: KvKey) -> bytes | None:
        self.stats.lookups += 1
        blob = self._read(key)
        if blob is not None:
            self.stats.hits += 1
            self.eviction.record_access(key)
        return blob

    def put(self, key: KvKey, blob: bytes, *, pinned: bool = False) -> bool:
        """Stores the blob (evicting unpinned entries as needed); `pinned`: it is pinned at once and bypasses the
        admission policy (it must still fit the budget)."""
        if len(blob) > self.budget_bytes or not (pinned or self.admission.admit(key, len(blob), self.budget_bytes)):
            return False
        self.remove(key)
        overflow = self.stats.bytes + len(blob) - self.budget_bytes
        if overflow > 0:
            victims = cast(list[KvKey], self.eviction.victims(overflow, self._pinned))  # keys it was given
            if sum(self._size_of(victim) for victim in victims) < overflow:
                return False
            for victim in victims:
                self.remove(victim)
                self.stats.evictions += 1
                self.on_evict(victim)
        self._write(key, blob)
        self.eviction.record_insert(key, len(blob))
        self.stats.entries += 1
        self.stats.bytes += len(blob)
        if pinned:
            self._pinned.add(key)
        return True

    def remove(self, key: KvKey) -> bool:
        freed = self._delete(key)
        if not freed:
            return False
        self.eviction.record_remove(key)
        self._pinned.discard(key)
        self.stats.entries -= 1
        self.stats.bytes -= freed
        return True

    def pin(self, key: KvKey) -> bool:
        """Protects an entry from eviction (e.g. while it is being streamed); False if absent."""
        if not self.contains(key):
            return False
        self._pinned.add(key)
        return True

    def unpin(self, key: KvKey) -> None:
        self._pinned.discard(key)

    @abstractmethod
    def _size_of(self, key: KvKey) -> int: ...


class MemoryTier(KvTier):
    """Blobs as uint8 tensors: in pinned host memory (`device="cpu", pinned=True`, needs CUDA), plain host
    memory, or GPU memory (`device="cuda"`)."""

    def __init__(self, name: str, budget_bytes: int, eviction: EvictionPolicy, admission: AdmissionPolicy,
                 device: str = "cpu", pinned: bool = False) -> None:
        super().__init__(name, budget_bytes, eviction, admission)
        self.device = device
        self.pinned_memory = pinned
        self._tensors: dict[KvKey, torch.Tensor] = {}

    def contains(self, key: KvKey) -> bool:
        return key in self._tensors

    def _read(self, key: KvKey) -> bytes | None:
        tensor = self._tensors.get(key)
        return None if tensor is None else tensor.cpu().numpy().tobytes()

    def _write(self, key: KvKey, blob: bytes) -> None:
        tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        if self.pinned_memory:
            tensor = tensor.pin_memory()
        self._tensors[key] = tensor.to(self.device)

    def _delete(self, key: KvKey) -> int:
        tensor = self._tensors.pop(key, None)
        return 0 if tensor is None else tensor.numel()

    def _size_of(self, key: KvKey) -> int:
        tensor = self._tensors.get(key)
        return 0 if tensor is None else tensor.numel()

    def keys(self) -> Iterator[KvKey]:
        return iter(list(self._tensors))


_CONTENT_ID = re.compile(r"[0-9a-f]{32}")
BLOB_SUFFIX = ".kv"


def _component(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def blob_name(key: KvKey) -> str:
    """A blob's relative name in a durable tier: profile/user/fact.v<version>.<content id>.kv (components quoted)."""
    return (f"{_component(key.profile_id)}/{_component(key.user_id)}/"
            f"{_component(key.fact_id)}.v{key.version}.{key.content_id}{BLOB_SUFFIX}")


def key_of_blob_name(name: str) -> KvKey | None:
    """The key a blob name names; None for a name that is not a blob's."""
    parts = name.split("/")
    if len(parts) != 3 or not parts[2].endswith(BLOB_SUFFIX):
        return None
    rest, _, content = parts[2][: -len(BLOB_SUFFIX)].rpartition(".")
    stem, _, version = rest.rpartition(".v")
    if not (version.isdigit() and _CONTENT_ID.fullmatch(content)):
        return None
    return KvKey(urllib.parse.unquote(parts[0]), urllib.parse.unquote(parts[1]), urllib.parse.unquote(stem),
                 int(version), content)


class DurableTier(KvTier):
    """The tier every stored blob is written to first, which survives restarts. Reads verify each blob's checksum
    and key: a torn or corrupted blob is deleted and reported through `on_corrupt`, never returned."""

    def __init__(self, name: str, budget_bytes: int, eviction: EvictionPolicy, admission: AdmissionPolicy) -> None:
        super().__init__(name, budget_bytes, eviction, admission)
        self.on_corrupt: Callable[[KvKey], None] = lambda key: None


class DiskTier(DurableTier):
    """Durable tier in a local directory: one file per blob, written atomically (temp file, fsync, rename).
    Existing files are found again at start (oldest first in LRU order); files not named like blobs are removed."""

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
            if read_kv_header(blob).key != key:
                raise CorruptKvBlob("the blob names another key than its file")
        except (OSError, CorruptKvBlob):
            self.remove(key)
            self.on_corrupt(key)
            return None
        return blob

    def _write(self, key: KvKey, blob: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp_name = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(handle, "wb") as temp_file:
                temp_file.write(blob)
                temp_file.flush()
                os.fsync(temp_file.fileno())
            os.replace(temp_name, path)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
        self._sizes[key] = len(blob)

    def _delete(self, key: KvKey) -> int:
        size = self._sizes.pop(key, 0)
        if size:
            self.path(key).unlink(missing_ok=True)
        return size

    def _size_of(self, key: KvKey) -> int:
        return self._sizes.get(key, 0)

    def keys(self) -> Iterator[KvKey]:
        return iter(list(self._sizes))
