"""Per-user fact matrices in memory, so that a query's exact top-k is one matrix-vector product instead of a
LanceDB scan (which costs milliseconds of CPU per query and queues under hundreds of concurrent callers).

LanceDB stays the source of truth: a user's entry is loaded from it on the first search, updated or dropped by
every write to that user, and only installed when no write to the user happened while it was being read. So a
cached entry holds exactly the user's committed facts, and ingest checks which facts exist against it.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from memory_service.models import ScoredFact, StoredFact

_GENERATION_STRIPES = 4096  # write generations per stripe of users: bounded memory, rare needless misses

FACT_ROW_COLUMNS = ("user_id", "fact_id", "text", "source_turn_id", "timestamp_us", "metadata_json", "version",
                    "created_at_us", "updated_at_us", "content_hash")
FactRow = tuple[str, str, str, str, int, str, int, int, int, str]
"""A cached fact: its FACT_ROW_COLUMNS in order, metadata as JSON text. A tuple of strings and ints is one that
Python's garbage collector stops tracking, so 100k cached facts do not add 200k objects (a StoredFact and its
metadata dict each) to every full collection, which stops the event loop for as long as it traverses them."""
_FACT_ID, _TEXT, _METADATA_JSON, _VERSION, _CREATED_AT_US, _CONTENT_HASH = (
    FACT_ROW_COLUMNS.index(name) for name in ("fact_id", "text", "metadata_json", "version", "created_at_us",
                                              "content_hash"))


def fact_row(record: Mapping[str, Any]) -> FactRow:
    """The FactRow of a record holding (at least) the FACT_ROW_COLUMNS, such as a LanceDB row."""
    return tuple(record[column] for column in FACT_ROW_COLUMNS)  # type: ignore[return-value]


def stored_fact(row: FactRow) -> StoredFact:
    user_id, fact_id, text, source_turn_id, timestamp_us, metadata_json, version, created_at_us, updated_at_us, _ = row
    return StoredFact(user_id=user_id, fact_id=fact_id, text=text, source_turn_id=source_turn_id,
                      timestamp_us=timestamp_us, metadata=json.loads(metadata_json), version=version,
                      created_at_us=created_at_us, updated_at_us=updated_at_us)


@dataclass(frozen=True)
class UserFacts:
    """A user's facts and their unit embeddings, vectors[i] belonging to rows[i]."""

    rows: list[FactRow]
    vectors: np.ndarray  # [len(rows), dim] float32
    # The user's write generation in the coordination store that these rows reflect (replicas sharing a store);
    # -1: unknown, so the entry is reloaded before it is used.
    store_generation: int = 0

    @property
    def nbytes(self) -> int:
        return self.vectors.nbytes + sum(len(row[_TEXT]) + len(row[_METADATA_JSON]) + 256 for row in self.rows)

    def versions(self, fact_ids: set[str]) -> dict[str, tuple[str, int, int]]:
        """fact_id -> (content_hash, version, created_at_us) for those of `fact_ids` the user has."""
        return {row[_FACT_ID]: (row[_CONTENT_HASH], row[_VERSION], row[_CREATED_AT_US])
                for row in self.rows if row[_FACT_ID] in fact_ids}

    def top_k(self, query_vector: np.ndarray, top_k: int) -> list[ScoredFact]:
        """Exact cosine top-k, best first (ties by fact_id, as LanceDB's exact search would return either)."""
        if not self.rows:
            return []
        scores = self.vectors @ query_vector.astype(np.float32)
        chosen = np.arange(len(scores)) if top_k >= len(scores) else np.argpartition(-scores, top_k - 1)[:top_k]
        ranked = sorted(chosen.tolist(), key=lambda i: (-float(scores[i]), self.rows[i][_FACT_ID]))
        return [ScoredFact(fact=stored_fact(self.rows[i]), score=float(scores[i])) for i in ranked]


class UserFactsCache:
    """LRU of UserFacts bounded by bytes. A user larger than the budget is marked until the next write to it and
    searched in LanceDB meanwhile (`may_hold` is False), so its facts are not read whole for every query.

    Writers call `upsert(user, ...)` or `invalidate(user)` after committing and before acknowledging; readers take
    `generation(user)` before reading LanceDB and pass it to `put`, which drops the entry if a write came in between.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, UserFacts] = OrderedDict()
        self._generations = [0] * _GENERATION_STRIPES
        self._oversize: set[str] = set()
        self._bytes = 0

    def get(self, user_id: str) -> UserFacts | None:
        entry = self._entries.get(user_id)
        if entry is not None:
            self._entries.move_to_end(user_id)
        return entry

    def may_hold(self, user_id: str) -> bool:
        return self.budget_bytes > 0 and user_id not in self._oversize

    def generation(self, user_id: str) -> int:
        return self._generations[self._stripe(user_id)]

    def put(self, user_id: str, entry: UserFacts, generation: int) -> bool:
        """Installs `entry` if no write to the user came since `generation` was taken and it fits the budget."""
        if generation != self.generation(user_id):
            return False
        if entry.nbytes > self.budget_bytes:
            self._oversize.add(user_id)
            return False
        self._drop(user_id)
        self._entries[user_id] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def upsert(self, user_id: str, rows: list[FactRow], vectors: np.ndarray, store_generation_before: int = 0,
               store_generation_after: int = 0) -> None:
        """Applies a committed write of `rows` (new facts, or replacing those with their fact_ids) to the user's
        entry, if cached, so that a write does not cost the next query a reload; like `invalidate`, drops reads in
        flight. On a shared store the merged entry reflects the write's generation (`..._after`) only if the entry
        reflected the one before it; otherwise it is left unlabelled (reloaded before use)."""
        entry = self._entries.get(user_id)
        self.invalidate(user_id)
        if entry is None:
            return
        position = {row[_FACT_ID]: index for index, row in enumerate(entry.rows)}
        merged_rows, merged_vectors = list(entry.rows), entry.vectors.copy()
        appended: list[int] = []
        for index, row in enumerate(rows):
            at = position.get(row[_FACT_ID])
            if at is None:
                appended.append(index)
                merged_rows.append(row)
            else:
                merged_rows[at] = row
                merged_vectors[at] = vectors[index]
        current = store_generation_after if entry.store_generation == store_generation_before else -1
        merged = UserFacts(merged_rows, np.concatenate([merged_vectors, vectors[appended]]), current)
        self.put(user_id, merged, self.generation(user_id))

    def invalidate(self, user_id: str) -> None:
        self._generations[self._stripe(user_id)] += 1
        self._oversize.discard(user_id)
        self._drop(user_id)

    @staticmethod
    def _stripe(user_id: str) -> int:
        return zlib.crc32(user_id.encode()) % _GENERATION_STRIPES

    def _drop(self, user_id: str) -> None:
        entry = self._entries.pop(user_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    @property
    def bytes_used(self) -> int:
        return self._bytes
