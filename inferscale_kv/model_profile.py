"""The KV profile of a model folder: hashes of weights, config, tokenizer and memory header."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from inferscale_kv.layout import memory_header_ids, token_hash
from inferscale_kv.profile import RECIPE, RECIPE_VERSION, kv_profile_id

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def _hash_files(paths: list[Path]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelProfile:
    model: str
    model_hash: str
    kv_dtype: str
    tokenizer_hash: str
    header_hash: str
    recipe: str
    recipe_version: int
    context_window: int
    max_context_tokens: int

    @property
    def profile_id(self) -> str:
        return kv_profile_id(self)

    def as_dict(self) -> dict:
        return {**self.__dict__, "profile_id": self.profile_id}


def build_model_profile(model_dir: Path, tokenizer, kv_dtype: str, context_window: int,
                        model_name: str | None = None) -> ModelProfile:
    """Hashes the folder's config and weights (content) and tokenizer files, and the memory header tokens; the
    window cap is the model's position limit (config.json's max_position_embeddings)."""
    weights = [p for p in model_dir.iterdir() if p.suffix in _WEIGHT_SUFFIXES]
    config = [p for p in (model_dir / "config.json", model_dir / "generation_config.json") if p.exists()]
    if not weights or not config:
        raise FileNotFoundError(f"{model_dir}: no config.json or weight files")
    tokenizer_files = [model_dir / name for name in _TOKENIZER_FILES if (model_dir / name).exists()]
    return ModelProfile(
        model=model_name or model_dir.name,
        model_hash=_hash_files(config + weights),
        kv_dtype=kv_dtype,
        tokenizer_hash=_hash_files(tokenizer_files),
        header_hash=token_hash(memory_header_ids(tokenizer)),
        recipe=RECIPE,
        recipe_version=RECIPE_VERSION,
        context_window=context_window,
        max_context_tokens=int(json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 0)),
    )
