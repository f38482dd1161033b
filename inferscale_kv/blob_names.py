"""Where a blob lives in a durable tier, shared byte for byte by the memory service (which writes and deletes it, in
a directory or a bucket) and the nodes (which read it there, inference_node.durable_blobs)."""

from __future__ import annotations

import re
import urllib.parse

from inferscale_kv.kv_key import KvKey

_CONTENT_ID = re.compile(r"[0-9a-f]{32}")
BLOB_SUFFIX = ".kv"


def _component(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def blob_name(key: KvKey) -> str:
    """A blob's relative name in a durable tier: profile/user/fact.v<version>.<content id>.kv (components quoted)."""
    return (f"{_component(key.profile_id)}/{_component(key.user_id)}/"
            f"{_component(key.fact_id)}.v{key.version}.{key.content_id}{BLOB_SUFFIX}")


def key_of_blob_name(name: str) -> KvKey | None:
    """The key a blob name names; None for a name that is not a blob's."""
    parts = name.split("/")
    if len(parts) != 3 or not parts[2].endswith(BLOB_SUFFIX):
        return None
    rest, _, content = parts[2][: -len(BLOB_SUFFIX)].rpartition(".")
    stem, _, version = rest.rpartition(".v")
    if not (version.isdigit() and _CONTENT_ID.fullmatch(content)):
        return None
    return KvKey(urllib.parse.unquote(parts[0]), urllib.parse.unquote(parts[1]), urllib.parse.unquote(stem),
                 int(version), content)


