"""The id rule of users, facts, turns, workers and nodes: one definition for the memory service and the nodes."""

from __future__ import annotations

import re

MAX_ID_CHARS = 128
# Ids appear in storage filters; this alphabet (no quotes, spaces or separators) keeps them inert there.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/=-]*")
ID_RULE = f"1-{MAX_ID_CHARS} characters of letters, digits and ._:@+/=- starting with a letter or digit"


def is_valid_id(value: str) -> bool:
    return 0 < len(value) <= MAX_ID_CHARS and ID_PATTERN.fullmatch(value) is not None
