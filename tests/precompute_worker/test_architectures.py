"""The pre-RoPE capture and rotary composition hold for every supported Llama-family architecture."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from inferscale_kv.rope import RotaryTables, apply_rope
from precompute_worker.encoder import EncodingGroup, FactEncoder, FactKey, FactSpec

SHAPE = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
CONFIGS = {
    "llama2": lambda: LlamaConfig(**SHAPE),
    "llama3.1-scaled": lambda: LlamaConfig(**SHAPE, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 500000.0}),
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SHAPE),  # biased k/v projections
    "qwen3": lambda: Qwen3Config(**SHAPE),  # q/k norms before the rotary embedding
}


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_rotated_stored_keys_match_plain_prefill(architecture: str) -> None:
    torch.manual_seed(0)
    config = CONFIGS[architecture]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.05)
    context = list(range(10, 40))
    fact = list(range(100, 112))
    (encoded,) = FactEncoder(model).encode([EncodingGroup(context, [FactSpec(FactKey("u", "f", 1), fact,
                                                                               len(context))])])
    with torch.no_grad():
        cache = model(torch.tensor([context + fact]), use_cache=True).past_key_values
    tables = RotaryTables.from_model(model, 128)
    rotated = apply_rope(encoded.keys, len(context), tables.cos, tables.sin)
    for index, layer in enumerate(cache.layers):
        assert (rotated[index] - layer.keys[0].transpose(0, 1)[len(context):]).abs().max() <= 1e-4
        assert (encoded.values[index] - layer.values[0].transpose(0, 1)[len(context):]).abs().max() <= 1e-4
