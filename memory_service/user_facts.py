"""A user's facts in memory: their rows and unit embeddings, so that a query's exact top-k is one matrix-vector
product instead of a LanceDB scan (which costs milliseconds of CPU per query and queues under hundreds of
concurrent callers), and their BM25 index for keyword queries, built at the first. The search cache holds these
(memory_service.user_writes says when a copy is current)."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from memory_service.keywords import KeywordIndex
from memory_service.models import ScoredFact, StoredFact
from memory_service.retrieval import SCORE_DECIMALS, rank_key

FACT_ROW_COLUMNS = ("user_id", "fact_id", "text", "source_turn_id", "timestamp_us", "metadata_json", "version",
                    "created_at_us", "updated_at_us", "content_hash")
FactRow = tuple[str, str, str, str, int, str, int, int, int, str]
"""A cached fact: its FACT_ROW_COLUMNS in order, metadata as JSON text. A tuple of strings and ints is one that
Python's garbage collector stops tracking, so 100k cached facts do not add 200k objects (a StoredFact and its
metadata dict each) to every full collection, which stops the event loop for as long as it traverses them."""
# Positions in a FactRow (literals, so that the type checker knows each field's type).
_FACT_ID: Final = 1
_TEXT: Final = 2
_METADATA_JSON: Final = 5
_VERSION: Final = 6
_CREATED_AT_US: Final = 7
_CONTENT_HASH: Final = 9
assert [FACT_ROW_COLUMNS[i] for i in (_FACT_ID, _TEXT, _METADATA_JSON, _VERSION, _CREATED_AT_US, _CONTENT_HASH)] == [
    "fact_id", "text", "metadata_json", "version", "created_at_us", "content_hash"]


def fact_row(record: Mapping[str, Any]) -> FactRow:
    """The FactRow of a record holding (at least) the FACT_ROW_COLUMNS, such as a LanceDB row."""
    return tuple(record[column] for column in FACT_ROW_COLUMNS)


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
    # This entry's own lock for building its keyword index (functools.cached_property's lock is one for every
    # instance on Python 3.11: one user's build would hold up every other user's first keyword query).
    _index_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """The bytes the entry holds, counting its keyword index (built or not) at three times its texts' length."""
        return self.vectors.nbytes + sum(4 * len(row[_TEXT]) + len(row[_METADATA_JSON]) + 256 for row in self.rows)

    def versions(self, fact_ids: set[str]) -> dict[str, tuple[str, int, int]]:
        """fact_id -> (content_hash, version, created_at_us) for those of `fact_ids` the user has."""
        return {row[_FACT_ID]: (row[_CONTENT_HASH], row[_VERSION], row[_CREATED_AT_US])
                for row in self.rows if row[_FACT_ID] in fact_ids}

    def top_k(self, query_vector: np.ndarray, top_k: int) -> list[ScoredFact]:
        """Exact cosine top-k, best first (ties by fact_id: retrieval.rank_key)."""
        if not self.rows:
            return []
        return ranked_facts(self.rows, self.vectors @ query_vector.astype(np.float32), top_k)

    @property
    def keyword_index(self) -> KeywordIndex:
        """BM25 over these facts' texts alone (built once, at the first use, while other entries' builds go on; a
        write makes a new UserFacts)."""
        built: KeywordIndex | None = self.__dict__.get("_keyword_index")
        if built is None:
            with self._index_lock:
                built = self.__dict__.get("_keyword_index")
                if built is None:
                    built = keyword_index(self.rows)
                    object.__setattr__(self, "_keyword_index", built)
        return built

    def keyword_top_k(self, query: str, top_k: int) -> list[ScoredFact]:
        """The top-k facts by BM25 of `query` over these facts alone, best first, ties by fact_id; facts sharing no
        word with the query are left out. The first call builds the index (CPU in proportion to the facts' text):
        call it off the event loop."""
        return keyword_ranked(self.rows, self.keyword_index, query, top_k)

    def merged(self, rows: list[FactRow], vectors: np.ndarray, store_generation: int) -> UserFacts:
        """These facts with `rows` written over them (replacing the rows of the same fact_ids, appending new ones),
        labelled `store_generation`."""
        position = {row[_FACT_ID]: index for index, row in enumerate(self.rows)}
        merged_rows, merged_vectors = list(self.rows), self.vectors.copy()
        appended: list[int] = []
        for index, row in enumerate(rows):
            at = position.get(row[_FACT_ID])
            if at is None:
                appended.append(index)
                merged_rows.append(row)
            else:
                merged_rows[at] = row
                merged_vectors[at] = vectors[index]
        return UserFacts(merged_rows, np.concatenate([merged_vectors, vectors[appended]]), store_generation)


def ranked_facts(rows: Sequence[FactRow], scores: np.ndarray, top_k: int,
                 among: np.ndarray | None = None) -> list[ScoredFact]:
    """The top-k of `rows` (all, or those at the indices `among`) by `scores` (scores[i] of rows[i]), best first,
    ties by fact_id (retrieval.rank_key)."""
    chosen = np.arange(len(rows)) if among is None else among
    if top_k < len(chosen):  # every fact tied with the k-th by rank_key is a candidate
        kth = float(np.partition(-scores[chosen], top_k - 1)[top_k - 1])
        chosen = chosen[-scores[chosen] <= kth + 10.0 ** -SCORE_DECIMALS]
    ranked = sorted(chosen.tolist(), key=lambda i: rank_key(float(scores[i]), rows[i][_FACT_ID]))[:top_k]
    return [ScoredFact(fact=stored_fact(rows[i]), score=float(scores[i])) for i in ranked]


def keyword_index(rows: Sequence[FactRow]) -> KeywordIndex:
    """BM25 over the texts of `rows` alone, in order."""
    return KeywordIndex([row[_TEXT] for row in rows])


def keyword_ranked(rows: Sequence[FactRow], index: KeywordIndex, query: str, top_k: int) -> list[ScoredFact]:
    """The top-k of `rows` by BM25 of `query` (`index` built over exactly these rows' texts, in order), best first,
    ties by fact_id; rows sharing no word with the query are left out."""
    scores = index.scores(query)
    return ranked_facts(rows, scores, top_k, among=np.flatnonzero(scores > 0))
