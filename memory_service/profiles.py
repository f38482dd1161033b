"""Validation of the KV profiles callers announce."""

from __future__ import annotations

from inferscale_kv.profile import ALL_PRECEDING_TURNS, KV_DTYPES, KvProfileLike, kv_profile_id
from memory_service.errors import InvalidArgument


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
