"""KV profiles: everything that changes the bytes of a fact's KV, and the id derived from it."""

from __future__ import annotations

import hashlib
import json
from typing import Protocol

from memory_service.errors import InvalidArgument

KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3")
ALL_PRECEDING_TURNS = -1


class KvProfileLike(Protocol):
    profile_id: str
    model: str
    model_hash: str
    kv_dtype: str
    tokenizer_hash: str
    header_hash: str
    recipe: str
    recipe_version: int
    context_window: int


def kv_profile_id(profile: KvProfileLike) -> str:
    """A content id of the profile's fields: equal ids mean interchangeable KV bytes."""
    canonical = json.dumps(
        [
            profile.model,
            profile.model_hash,
            profile.kv_dtype,
            profile.tokenizer_hash,
            profile.header_hash,
            profile.recipe,
            profile.recipe_version,
            profile.context_window,
        ]
    )
    return "kvp-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


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
    expected = kv_profile_id(profile)
    if profile.profile_id != expected:
        raise InvalidArgument(f"{field}.profile_id", f"does not match the profile's fields (expected {expected})")
    return expected
