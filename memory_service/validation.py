"""Request validation: turns wire messages into domain records or raises InvalidArgument/LimitExceeded.

A handler checks every field of its request here before it calls the domain, so a rejected call changes nothing.
What KV blobs must be is memory_service.kv_checks', which the KV messages here call.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from inferscale_kv.ids import ID_PATTERN as _ID_PATTERN
from inferscale_kv.ids import ID_RULE as _ID_RULE
from inferscale_kv.ids import MAX_ID_CHARS
from inferscale_kv.profile import ALL_PRECEDING_TURNS, KV_DTYPES, KvProfileLike, kv_profile_id, profile_fields
from memory_service.config import Limits
from memory_service.errors import InvalidArgument, LimitExceeded
from memory_service.kv_checks import check_names_fact, check_names_header, checked_upload
from memory_service.models import (
    AnnouncedProfile,
    FactKvRef,
    KvUpload,
    NewFact,
    NewTurn,
    Query,
    RetrievalMode,
)


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


def validate_query_vector(vector: Sequence[float], model_id: str, service_model_id: str, dim: int) -> np.ndarray:
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


def validate_query(text: str, vector: Sequence[float], model_id: str, limits: Limits, service_model_id: str,
                   dim: int, mode: RetrievalMode) -> Query:
    """A search's query: the caller's vector when it sends one (of the service's model), and its text, which the
    keyword and hybrid modes need (vector mode ignores it when the vector comes)."""
    if vector and mode is RetrievalMode.VECTOR:
        return Query(vector=validate_query_vector(vector, model_id, service_model_id, dim))
    if not text.strip() and vector:
        raise InvalidArgument("query", f"must not be empty in {mode.value} retrieval (it searches the query's text)")
    query_text = validate_text(text, "query", limits.max_query_chars)
    return Query(text=query_text,
                 vector=validate_query_vector(vector, model_id, service_model_id, dim) if vector else None)



def derived_fact_id(text: str) -> str:
    """The id of a fact sent without one: the same text always maps to the same fact."""
    return "f-" + hashlib.sha256(text.encode()).hexdigest()[:24]


MAX_TIMESTAMP_SECONDS = 253_402_300_799  # 9999-12-31T23:59:59Z, the end of protobuf's Timestamp range


def timestamp_us(timestamp: TimestampLike, field: str) -> int:
    if not 0 <= timestamp.seconds <= MAX_TIMESTAMP_SECONDS or not 0 <= timestamp.nanos < 1_000_000_000:
        raise InvalidArgument(field, "must be a time from 1970-01-01 to 9999-12-31")
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


def validate_kv_refs(refs: Sequence[Any], limits: Limits) -> list[FactKvRef]:
    """A FetchKv's fact references (none: the header alone): at most a request's facts (--max-top-k), each with a
    valid fact id."""
    if len(refs) > limits.max_top_k:
        raise LimitExceeded("facts", f"{len(refs)} entries exceeds the limit of {limits.max_top_k} per call")
    return [FactKvRef(validate_id(ref.fact_id, f"facts[{index}].fact_id"), ref.version, ref.content_id)
            for index, ref in enumerate(refs)]


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


Number = TypeVar("Number", int, float)


def validate_non_negative(value: Number, field: str) -> Number:
    if value < 0:
        raise InvalidArgument(field, "must not be negative")
    return value


def validate_rate(value: float, field: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(field, "must be a finite, non-negative rate")
    return value


# ------------------------------------------------------------------ KV profiles and blobs


def validate_profile(profile: KvProfileLike, field: str = "profile") -> str:
    """Checks a profile's fields and its id; returns the id."""
    for name in ("model", "model_hash", "tokenizer_hash", "header_hash", "recipe"):
        if not getattr(profile, name):
            raise InvalidArgument(f"{field}.{name}", "must not be empty")
    if profile.kv_dtype not in KV_DTYPES:
        raise InvalidArgument(f"{field}.kv_dtype", f"{profile.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if profile.recipe_version < 1:
        raise InvalidArgument(f"{field}.recipe_version", "must be at least 1")
    if profile.context_window < ALL_PRECEDING_TURNS:
        raise InvalidArgument(f"{field}.context_window", "must be >= 0, or -1 for all preceding turns")
    if profile.max_context_tokens < 0:
        raise InvalidArgument(f"{field}.max_context_tokens", "must be >= 0 (0: no cap)")
    expected = kv_profile_id(profile)
    if profile.profile_id != expected:
        raise InvalidArgument(f"{field}.profile_id", f"does not match the profile's fields (expected {expected})")
    return expected


def validate_announced_profile(profile: KvProfileLike, field: str = "profile") -> AnnouncedProfile:
    return AnnouncedProfile(validate_profile(profile, field), profile_fields(profile))


def validate_header_kv(blob: bytes, profile: AnnouncedProfile, field: str = "header_kv") -> KvUpload:
    """A profile's memory header KV (kv_checks.checked_upload, kv_checks.check_names_header)."""
    upload = checked_upload(blob, field)
    check_names_header(upload, profile, field)
    return upload


class FactKvUploadLike(Protocol):
    user_id: str
    fact_id: str
    version: int
    blob: bytes


def validate_fact_kv(uploads: Sequence[FactKvUploadLike], profile_id: str,
                     field: str = "results") -> list[KvUpload]:
    """A worker's fact KV, each blob checked (kv_checks.checked_upload) and naming the profile, fact and version it is
    uploaded for (kv_checks.check_names_fact)."""
    validated: list[KvUpload] = []
    for index, upload in enumerate(uploads):
        blob_field = f"{field}[{index}].blob"
        checked = checked_upload(upload.blob, blob_field)
        check_names_fact(checked, profile_id, upload.user_id, upload.fact_id, upload.version, blob_field)
        validated.append(checked)
    return validated
