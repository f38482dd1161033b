"""The KV shape of a Llama-family model config: what workers store per fact, the memory service checks of every blob
of a profile, and nodes write per token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvShape:
    """The per-token layout of KV (layers x KV heads x head dim): every blob of a profile has the same."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> KvShape:
        """From an HF config; `head_dim` where the model sets it, else hidden_size / attention heads."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim)

    def of(self, num_tokens: int) -> tuple[int, int, int, int]:
        """The `[layers, tokens, kv_heads, head_dim]` shape of K (or V) for `num_tokens` tokens."""
        return (self.num_layers, num_tokens, self.num_kv_heads, self.head_dim)

    def elements_per_token(self) -> int:
        """K and V elements of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
