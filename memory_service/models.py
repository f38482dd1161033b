"""Validated domain records that flow between the gRPC layer and the domain (memory_service.operations, the fact
store, the KV pipeline): wire-format free."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from inferscale_kv.kv_key import KvKey
from inferscale_kv.shape import KvShape


@dataclass(frozen=True)
class NewFact:
    fact_id: str
    text: str
    source_turn_id: str = ""
    timestamp_us: int = 0
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def content_hash(self) -> str:
        """Hash of everything a client can change; equal hashes mean a retry, not an update."""
        canonical = json.dumps(
            [self.text, self.source_turn_id, self.timestamp_us, sorted(self.metadata.items())],
            ensure_ascii=False,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class StoredFact:
    user_id: str
    fact_id: str
    text: str
    source_turn_id: str
    timestamp_us: int
    metadata: dict[str, str]
    version: int
    created_at_us: int
    updated_at_us: int


@dataclass(frozen=True)
class ScoredFact:
    fact: StoredFact
    score: float


@dataclass(frozen=True)
class NewTurn:
    turn_id: str
    seq: int
    session_id: str
    speaker: str
    text: str
    timestamp_us: int = 0


@dataclass(frozen=True)
class StoredTurn:
    turn_id: str
    seq: int
    session_id: str
    speaker: str
    text: str
    timestamp_us: int


class IngestOutcome(Enum):
    CREATED = "created"
    UPDATED = "updated"
    UNCHANGED = "unchanged"


@dataclass(frozen=True)
class IngestResult:
    fact_id: str
    version: int
    outcome: IngestOutcome


@dataclass(frozen=True)
class StoreCounts:
    users: int
    facts: int
    turns: int


class RetrievalMode(Enum):
    """How a user's facts are ranked against a query (memory_service.retrieval)."""

    VECTOR = "vector"  # exact cosine of the embeddings
    KEYWORD = "keyword"  # BM25 over the facts' text
    HYBRID = "hybrid"  # both, fused, and a date the query names matched against the facts'


@dataclass(frozen=True)
class Query:
    """A search's query: its text (embedded by the service when no vector comes with it; searched by keyword in the
    keyword and hybrid modes), and the caller's own embedding of it, if sent (a unit vector of the service's
    embedding model). A query has a vector or a text, and a text in the keyword and hybrid modes."""

    text: str = ""
    vector: np.ndarray | None = None


@dataclass(frozen=True)
class AnnouncedProfile:
    """A KV profile a caller serves: its id and its fields (inferscale_kv.profile.PROFILE_FIELDS)."""

    profile_id: str
    fields: dict[str, str | int]


@dataclass(frozen=True)
class Announcer:
    """Who announces a profile: its id and the role its request declares ("worker", "node", or "" unspecified)."""

    announcer_id: str
    role: str


@dataclass(frozen=True)
class KvUpload:
    """A checked KV blob (checksum, key, finite values): the key, token ids, storage dtype and layout its header
    names."""

    key: KvKey
    token_ids: tuple[int, ...]
    blob: bytes
    storage_dtype: str
    shape: KvShape


@dataclass(frozen=True)
class FactKvRef:
    """One version of a fact's KV, named by the content id its entry was listed with."""

    fact_id: str
    version: int
    content_id: str
