"""Request validation: turns wire messages into domain records or raises InvalidArgument/LimitExceeded.

Everything is checked before anything is written, so a rejected call changes nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from memory_service.config import Limits
from memory_service.errors import InvalidArgument, LimitExceeded
from memory_service.models import NewFact, NewTurn

MAX_ID_CHARS = 128
# Ids appear in storage filters; this alphabet (no quotes, spaces or separators) keeps them inert there.
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/=-]*")
_ID_RULE = f"1-{MAX_ID_CHARS} characters of letters, digits and ._:@+/=- starting with a letter or digit"


class TimestampLike(Protocol):
    seconds: int
    nanos: int


class FactLike(Protocol):
    fact_id: str
    text: str
    source_turn_id: str
    timestamp: TimestampLike
    metadata: Mapping[str, str]


class TurnLike(Protocol):
    turn_id: str
    seq: int
    session_id: str
    speaker: str
    text: str
    timestamp: TimestampLike


def validate_id(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(field, "must not be empty")
    if len(value) > MAX_ID_CHARS or not _ID_PATTERN.fullmatch(value):
        raise InvalidArgument(field, f"{value[:40]!r} is not a valid id ({_ID_RULE})")
    return value


def validate_optional_id(value: str, field: str) -> str:
    return validate_id(value, field) if value else ""


def validate_text(value: str, field: str, max_chars: int) -> str:
    if not value.strip():
        raise InvalidArgument(field, "must not be empty or whitespace")
    if "\x00" in value:
        raise InvalidArgument(field, "must not contain NUL characters")
    if len(value) > max_chars:
        raise LimitExceeded(field, f"{len(value)} characters exceeds the limit of {max_chars}")
    return value


def validate_query_vector(vector, model_id: str, service_model_id: str, dim: int) -> np.ndarray:
    """A caller's query embedding as a unit float32 vector, if it comes from the service's model."""
    if model_id != service_model_id:
        raise InvalidArgument("embedding_model_id", f"{model_id!r} is not this service's embedding model "
                              f"{service_model_id!r} (GetStats names it)")
    values = np.asarray(vector, dtype=np.float64)
    if values.shape != (dim,):
        raise InvalidArgument("query_vector", f"has {values.size} values; the model's vectors have {dim}")
    norm = float(np.linalg.norm(values)) if np.isfinite(values).all() else float("nan")
    if not np.isfinite(norm) or norm == 0.0:
        raise InvalidArgument("query_vector", "must be finite and not all zero")
    return (values / norm).astype(np.float32)


def derived_fact_id(text: str) -> str:
    """The id of a fact sent without one: the same text always maps to the same fact."""
    return "f-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def timestamp_us(timestamp: TimestampLike, field: str) -> int:
    if timestamp.seconds < 0 or not 0 <= timestamp.nanos < 1_000_000_000:
        raise InvalidArgument(field, "must be a time after 1970-01-01")
    return timestamp.seconds * 1_000_000 + timestamp.nanos // 1000


def _validate_metadata(metadata: Mapping[str, str], field: str, limits: Limits) -> dict[str, str]:
    if len(metadata) > limits.max_metadata_entries:
        raise LimitExceeded(field, f"{len(metadata)} entries exceeds the limit of {limits.max_metadata_entries}")
    for key, value in metadata.items():
        if not key or len(key) > MAX_ID_CHARS:
            raise InvalidArgument(f"{field}[{key[:40]!r}]", f"keys must have 1-{MAX_ID_CHARS} characters")
        if len(value) > limits.max_metadata_value_chars:
            raise LimitExceeded(
                f"{field}[{key!r}]", f"value of {len(value)} characters exceeds {limits.max_metadata_value_chars}"
            )
    return dict(metadata)


def _check_batch(count: int, field: str, limit: int) -> None:
    if count == 0:
        raise InvalidArgument(field, "must contain at least one entry")
    if count > limit:
        raise LimitExceeded(field, f"{count} entries exceeds the limit of {limit} per call")


def validate_facts(facts: Sequence[FactLike], limits: Limits) -> list[NewFact]:
    _check_batch(len(facts), "facts", limits.max_facts_per_call)
    validated: list[NewFact] = []
    index_by_id: dict[str, int] = {}
    for index, fact in enumerate(facts):
        field = f"facts[{index}]"
        text = validate_text(fact.text, f"{field}.text", limits.max_fact_chars)
        fact_id = validate_optional_id(fact.fact_id, f"{field}.fact_id") or derived_fact_id(text)
        if fact_id in index_by_id:
            raise InvalidArgument(f"{field}.fact_id", f"{fact_id!r} repeats facts[{index_by_id[fact_id]}]")
        index_by_id[fact_id] = index
        validated.append(
            NewFact(
                fact_id=fact_id,
                text=text,
                source_turn_id=validate_optional_id(fact.source_turn_id, f"{field}.source_turn_id"),
                timestamp_us=timestamp_us(fact.timestamp, f"{field}.timestamp"),
                metadata=_validate_metadata(fact.metadata, f"{field}.metadata", limits),
            )
        )
    return validated


def validate_turns(turns: Sequence[TurnLike], limits: Limits) -> list[NewTurn]:
    _check_batch(len(turns), "turns", limits.max_turns_per_call)
    validated: list[NewTurn] = []
    index_by_id: dict[str, int] = {}
    for index, turn in enumerate(turns):
        field = f"turns[{index}]"
        turn_id = validate_id(turn.turn_id, f"{field}.turn_id")
        if turn_id in index_by_id:
            raise InvalidArgument(f"{field}.turn_id", f"{turn_id!r} repeats turns[{index_by_id[turn_id]}]")
        index_by_id[turn_id] = index
        if turn.seq < 0:
            raise InvalidArgument(f"{field}.seq", "must not be negative")
        if len(turn.speaker) > MAX_ID_CHARS:
            raise LimitExceeded(f"{field}.speaker", f"longer than {MAX_ID_CHARS} characters")
        validated.append(
            NewTurn(
                turn_id=turn_id,
                seq=turn.seq,
                session_id=validate_optional_id(turn.session_id, f"{field}.session_id"),
                speaker=turn.speaker,
                text=validate_text(turn.text, f"{field}.text", limits.max_turn_chars),
                timestamp_us=timestamp_us(turn.timestamp, f"{field}.timestamp"),
            )
        )
    return validated


def resolve_top_k(top_k: int, limits: Limits) -> int:
    if top_k < 0:
        raise InvalidArgument("top_k", f"{top_k} is negative")
    if top_k > limits.max_top_k:
        raise LimitExceeded("top_k", f"{top_k} exceeds the limit of {limits.max_top_k}")
    return top_k or limits.default_top_k


def resolve_page_size(page_size: int, limits: Limits) -> int:
    if page_size < 0:
        raise InvalidArgument("page_size", f"{page_size} is negative")
    return min(page_size or limits.default_page_size, limits.max_page_size)


def validate_fact_ids(fact_ids: Sequence[str], limits: Limits) -> list[str]:
    _check_batch(len(fact_ids), "fact_ids", limits.max_delete_ids)
    return list(dict.fromkeys(validate_id(fact_id, f"fact_ids[{i}]") for i, fact_id in enumerate(fact_ids)))


def encode_page_token(last_fact_id: str) -> str:
    return base64.urlsafe_b64encode(last_fact_id.encode()).decode()


def decode_page_token(token: str) -> str:
    """The fact id after which the page starts ("" for the first page)."""
    if not token:
        return ""
    try:
        last_fact_id = base64.urlsafe_b64decode(token.encode()).decode()
        return validate_id(last_fact_id, "page_token")
    except (binascii.Error, UnicodeDecodeError, ValueError, InvalidArgument):
        raise InvalidArgument("page_token", "is not a token returned by ListFacts") from None
