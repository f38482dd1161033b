"""Config-only model folders for GPU speed runs: e.g. a Llama-3-8B-shaped model that vLLM serves with dummy weights.

The folder holds the shape (config.json), a real tokenizer (copied from a local model folder, so the OpenAI
path and the memory service tokenize real text) and a placeholder weights file, so that the KV profile has
content to hash. The vocabulary is the tokenizer's; every other dimension is Llama-3-8B's. Speed runs only:
`--load-format dummy` gives random weights, and fact KV comes from the synthetic worker.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

# config.json contents: values of JSON's types, read by transformers and vLLM.
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# A small Llama for checking a speed-run setup on the CPU before spending GPU time on it.
LLAMA_TINY: dict[str, Any] = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
SHAPES = {"llama3-8b": LLAMA3_8B, "llama-tiny": LLAMA_TINY}
PLACEHOLDER_WEIGHTS = "dummy-weights.safetensors"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "chat_template.jinja", "generation_config.json")


def build_dummy_model(target: Path, shape: str, tokenizer_dir: Path, dtype: str = "bfloat16") -> Path:
    """Writes the folder for one of SHAPES (idempotent) and returns it."""
    from transformers import AutoTokenizer

    target.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, target / name)
    tokenizer = AutoTokenizer.from_pretrained(target)
    config = {**SHAPES[shape], "torch_dtype": dtype, "vocab_size": len(tokenizer),
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (target / "config.json").write_text(json.dumps(config, indent=1))
    (target / PLACEHOLDER_WEIGHTS).write_text("dummy weights: vLLM --load-format dummy; KV from the synthetic worker\n")
    return target
