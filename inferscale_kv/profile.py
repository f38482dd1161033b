"""KV profiles: everything that changes the bytes of a fact's KV, and the id derived from it."""

from __future__ import annotations

import hashlib
import json
from typing import Protocol

KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3")
ALL_PRECEDING_TURNS = -1
# Context-Window Encoding's default window (turns before a fact's source turn), chosen on answer quality
# (benchmarks/RESULTS.md, "LoCoMo quality on all six development conversations"). It is in the profile: workers and
# nodes must agree on it.
DEFAULT_CONTEXT_WINDOW = 50
RECIPE = "chunked-rope-cwe"
# Bump when the encoding changes in any way that changes bytes (window rule, turn rendering, the neutral form of
# stored text, capture point).
RECIPE_VERSION = 2


class KvProfileLike(Protocol):
    """A profile's fields, read only: the protobuf KvProfile and ModelProfile both carry them."""

    @property
    def profile_id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def model_hash(self) -> str: ...

    @property
    def kv_dtype(self) -> str: ...

    @property
    def tokenizer_hash(self) -> str: ...

    @property
    def header_hash(self) -> str: ...

    @property
    def recipe(self) -> str: ...

    @property
    def recipe_version(self) -> int: ...

    @property
    def context_window(self) -> int: ...

    @property
    def max_context_tokens(self) -> int: ...


# Every field that changes a fact's KV bytes, in the order the profile id hashes them.
PROFILE_FIELDS = ("model", "model_hash", "kv_dtype", "tokenizer_hash", "header_hash", "recipe", "recipe_version",
                  "context_window", "max_context_tokens")


def profile_fields(profile: KvProfileLike) -> dict:
    return {name: getattr(profile, name) for name in PROFILE_FIELDS}


def kv_profile_id(profile: KvProfileLike) -> str:
    """A content id of the profile's fields: equal ids mean interchangeable KV bytes."""
    canonical = json.dumps([getattr(profile, name) for name in PROFILE_FIELDS])
    return "kvp-" + hashlib.sha256(canonical.encode()).hexdigest()[:32]


def window_start(source_index: int, context_window: int) -> int:
    """Index of the first conversation turn a fact from turn `source_index` is encoded behind.

    Windows are anchored at multiples of w so that the facts of one anchor share a single forward pass
    (the context of each is a prefix of the anchor's conversation slice): a fact sees between w and 2w-1
    preceding turns (fewer at the start of the conversation). w = -1 means all preceding turns, w = 0 none.
    """
    if context_window == ALL_PRECEDING_TURNS:
        return 0
    if context_window == 0:
        return source_index
    return max(0, (source_index - context_window) // context_window * context_window)
