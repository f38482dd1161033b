"""When injecting a request's memory costs more than prefilling it: below a memory size (the crossover, measured per
model shape, dtype and device by `python -m benchmarks.serve`), the node serves the memory as text, so kv is never
slower than text. Measured crossovers ship in kv_crossover.json; `--kv-crossover-tokens N` overrides them, and
`--kv-crossover-tokens measured` (the default) takes the measured one. A request's memory.kv_crossover_tokens is the
number a node so resolved, or another the request gives."""

from __future__ import annotations

import json
from pathlib import Path

from inference_node.memory_request import MAX_MEMORY_TOKENS

CROSSOVER_TABLE = Path(__file__).with_name("kv_crossover.json")
MEASURED = "measured"  # --kv-crossover-tokens: the crossover measured for the node's shape, dtype and device


def crossover_flag(text: str) -> str:
    """--kv-crossover-tokens' value: MEASURED, or a whole number of tokens (as text) up to MAX_MEMORY_TOKENS, what a
    request may give (the node's number is its requests' default). A negative number is MEASURED: the flag spelled
    it -1 before it had a name."""
    if text == MEASURED:
        return MEASURED
    try:
        tokens = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither {MEASURED} nor a number of tokens") from None
    if tokens > MAX_MEMORY_TOKENS:
        raise ValueError(f"{tokens} is more than {MAX_MEMORY_TOKENS} tokens, the most a memory may hold")
    return MEASURED if tokens < 0 else str(tokens)


def shape_key(hf_config, dtype: str, device: str) -> str:
    """What a crossover depends on: the model's compute shape, the dtype it runs in and the device."""
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return (f"{hf_config.model_type}-{hf_config.num_hidden_layers}L-{hf_config.hidden_size}h-"
            f"{hf_config.intermediate_size}ff-{kv_heads}kv:{dtype}:{device}")


def measured_crossover(key: str) -> int | None:
    """The smallest injectable memory (tokens) at which kv was measured faster than text (at most
    MAX_MEMORY_TOKENS), or None if unmeasured."""
    entry = json.loads(CROSSOVER_TABLE.read_text())["crossovers"].get(key)
    return None if entry is None else min(int(entry["tokens"]), MAX_MEMORY_TOKENS)
