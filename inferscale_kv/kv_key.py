"""The name of a piece of fact KV, shared byte for byte by the memory service, the workers and the nodes.

A key names everything that determines the KV's bytes: the profile (model, weights, dtype, RoPE, layout), the
content id (a digest of the tokens the chunk attended to, header and window turns, and of its own token ids),
and, for bookkeeping, the owner, the fact id and the version. The same key can therefore never mean other bytes:
a fact re-created under the same id with other text (or another context) gets another content id, and a version
is never handed out twice (the store keeps a version floor per user across deletes).

The memory header is keyed apart from every fact: its owner is `HEADER_OWNER`, which is not a valid user id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from inferscale_kv.layout import token_hash

# The owner of a profile's memory header KV: outside the id alphabet (ids start with a letter or digit).
HEADER_OWNER = "_profile"
HEADER_FACT_ID = "header"
HEADER_VERSION = 1


def content_id(profile_id: str, context_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """Digest of what a chunk's KV depends on besides the profile: the tokens it attended to and its own."""
    material = f"{profile_id}|{len(context_ids)}:{token_hash(context_ids)}|{len(token_ids)}:{token_hash(token_ids)}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


@dataclass(frozen=True, order=True)
class KvKey:
    profile_id: str
    user_id: str  # the fact's user, or HEADER_OWNER
    fact_id: str
    version: int
    content_id: str

    @property
    def is_header(self) -> bool:
        return self.user_id == HEADER_OWNER


def header_key(profile_id: str, header_ids: Sequence[int]) -> KvKey:
    """The key of a profile's memory header KV (a plain prefix: it attends to nothing before it)."""
    return KvKey(profile_id, HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, content_id(profile_id, (), header_ids))
