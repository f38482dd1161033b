"""Chunked RoPE composition: rotate stored pre-RoPE keys to their final positions with the model's own tables.

The tables come from the model's own rotary embedding module (transformers), so rope scaling (llama3, yarn,
linear) is whatever the model uses; scalings that change with the sequence length are refused. Rotation is the
"rotate half" (NeoX) form that Llama-family models and vLLM's Llama implementation use.
"""

from __future__ import annotations

import torch

# Model types whose attention applies full-width rotate-half (NeoX) RoPE to every key, as composed here.
NEOX_LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})


# Rope scalings whose position tables are fixed (the same at every sequence length) and computed alike by
# transformers and vLLM. "dynamic" NTK is not: transformers rescales with the sequence length, vLLM once.
SCALED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class UnsupportedRotary(ValueError):
    """The model's rotary embedding is not the full-width NeoX form that Chunked RoPE composes."""


def check_rotary_supported(config) -> None:
    """Raises UnsupportedRotary unless injected keys would be rotated exactly as the model rotates its own."""
    model_type = getattr(config, "model_type", "")
    if model_type not in NEOX_LLAMA_FAMILY:
        raise UnsupportedRotary(f"model type {model_type!r}: InferScale composes the full rotate-half RoPE of "
                                f"{', '.join(sorted(NEOX_LLAMA_FAMILY))} models only")
    partial = getattr(config, "partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise UnsupportedRotary(f"partial_rotary_factor={partial}: only full-width rotary embeddings are supported")
    scaling = getattr(config, "rope_scaling", None) or {}
    if "mrope_section" in scaling:
        raise UnsupportedRotary("multimodal rotary embeddings (mrope) are not supported")
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type not in SCALED_ROPE_TYPES:
        raise UnsupportedRotary(f"rope type {rope_type!r}: supported are {', '.join(sorted(SCALED_ROPE_TYPES))} "
                                "(transformers' tables and vLLM's must agree at every position)")


class RotaryTables:
    """cos/sin of a model's rotary embedding for positions [0, max_positions)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos = cos  # [max_positions, head_dim]
        self.sin = sin

    @classmethod
    def from_model(cls, model: torch.nn.Module, max_positions: int, device: torch.device | str = "cpu") -> RotaryTables:
        """Evaluates the model's own rotary module (`model.model.rotary_emb`) at every position."""
        return cls.from_rotary(model.get_submodule("model.rotary_emb"), max_positions, device)

    @classmethod
    def from_config(cls, config, max_positions: int, device: torch.device | str = "cpu") -> RotaryTables:
        """Builds the model's rotary module from its HF config alone (no weights needed)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return cls.from_rotary(LlamaRotaryEmbedding(config=config).to(device), max_positions, device)

    @classmethod
    def from_rotary(cls, rotary: torch.nn.Module, max_positions: int, device: torch.device | str) -> RotaryTables:
        """Evaluates a transformers rotary embedding module at every position."""
        positions = torch.arange(max_positions, device=device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        with torch.no_grad():
            cos, sin = rotary(probe, positions)
        return cls(cos[0].float(), sin[0].float())

    def to(self, device: torch.device | str) -> RotaryTables:
        return RotaryTables(self.cos.to(device), self.sin.to(device))


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    half = tensor.shape[-1] // 2
    return torch.cat((-tensor[..., half:], tensor[..., :half]), dim=-1)


def apply_rope(keys: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pre-RoPE keys [..., tokens, kv_heads, head_dim] to the contiguous positions start, start+1, ...
    `cos`/`sin` are a RotaryTables' tables, already in the keys' dtype and on their device."""
    count = keys.shape[-3]
    cos = cos[start : start + count, None, :]
    sin = sin[start : start + count, None, :]
    return torch.addcmul(keys * cos, rotate_half(keys), sin)
