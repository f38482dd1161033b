"""Fact KV computation with the model's own code (HF transformers).

Many facts are packed into one forward pass: each encoding group is a context (header and conversation
turns) followed by its facts, and a 4-D attention mask lets every fact see exactly its own prefix of the
context and itself, never another fact. Positions continue from each fact's prefix, so a fact's hidden
states are those of a plain forward over prefix + fact. Keys are captured *before* the rotary embedding
(output of k_proj, or of k_norm where the model normalizes keys) and values as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.hooks import RemovableHandle

from inferscale_kv.rope import check_rotary_supported
from inferscale_kv.shape import KvShape

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class FactKey:
    user_id: str
    fact_id: str
    version: int


@dataclass(frozen=True)
class FactSpec:
    key: FactKey
    token_ids: list[int]
    # How many leading context tokens the fact attends to (header + its window of turns).
    prefix_length: int


@dataclass
class EncodingGroup:
    context_ids: list[int]
    facts: list[FactSpec] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + sum(len(fact.token_ids) for fact in self.facts)


@dataclass(frozen=True)
class EncodedFact:
    spec: FactSpec
    keys: torch.Tensor  # pre-RoPE, [layers, tokens, kv_heads, head_dim]
    values: torch.Tensor
    context_ids: tuple[int, ...] = ()  # the context tokens the fact attended to (header and window turns)


class _KvCapture:
    """Forward hooks that record every layer's pre-RoPE keys and values of one forward pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self._handles: list[RemovableHandle] = []
        layers = list(model.get_submodule("model.layers").children())
        for index, layer in enumerate(layers):
            attention = layer.get_submodule("self_attn")
            key_module = attention.get_submodule("k_norm" if hasattr(attention, "k_norm") else "k_proj")
            self._handles.append(key_module.register_forward_hook(self._recorder(self.keys, index)))
            value_module = attention.get_submodule("v_proj")
            self._handles.append(value_module.register_forward_hook(self._recorder(self.values, index)))
        self.keys.extend([None] * len(layers))
        self.values.extend([None] * len(layers))

    @staticmethod
    def _recorder(store: list, index: int):
        def hook(module, inputs, output):
            store[index] = output.detach()

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    @staticmethod
    def stacked(recorded: list[torch.Tensor | None], shape: tuple[int, int, int]) -> torch.Tensor:
        """One forward's per-layer records, each reshaped to `shape`, stacked: [layers, *shape]."""
        tensors = []
        for index, tensor in enumerate(recorded):
            if tensor is None:
                raise RuntimeError(f"layer {index}: the forward pass recorded no keys or values")
            tensors.append(tensor.reshape(shape))
        return torch.stack(tensors)


class FactEncoder:
    """Encodes groups of facts with a causal LM of the Llama family (Llama 2/3, Mistral, Qwen2/3, SmolLM2)."""

    def __init__(self, model: PreTrainedModel, max_tokens_per_forward: int = 2048) -> None:
        self.model = model.eval()
        self.config = model.config
        shape = KvShape.from_config(self.config)
        self.num_kv_heads, self.head_dim, self.num_layers = shape.num_kv_heads, shape.head_dim, shape.num_layers
        self.max_tokens_per_forward = max_tokens_per_forward
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @classmethod
    def from_pretrained(
        cls, model_dir: Path | str, dtype: str = "float32", device: str = "cpu", max_tokens_per_forward: int = 2048
    ) -> FactEncoder:
        from transformers import AutoConfig, AutoModelForCausalLM

        check_rotary_supported(AutoConfig.from_pretrained(model_dir))  # before loading weights
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa")
        return cls(model.to(device), max_tokens_per_forward)

    def encode(self, groups: Sequence[EncodingGroup]) -> list[EncodedFact]:
        """Encodes every fact of every group; forwards hold up to max_tokens_per_forward tokens."""
        encoded: list[EncodedFact] = []
        for pack in self._packs(groups):
            encoded.extend(self._encode_pack(pack))
        return encoded

    def _packs(self, groups: Sequence[EncodingGroup]) -> Iterator[list[EncodingGroup]]:
        pack: list[EncodingGroup] = []
        tokens = 0
        for group in groups:
            if pack and tokens + group.num_tokens > self.max_tokens_per_forward:
                yield pack
                pack, tokens = [], 0
            pack.append(group)
            tokens += group.num_tokens
        if pack:
            yield pack

    def _encode_pack(self, groups: list[EncodingGroup]) -> list[EncodedFact]:
        input_ids: list[int] = []
        positions: list[int] = []
        # (row start, row end, [allowed column ranges]) per block, for the mask.
        blocks: list[tuple[int, int, int, int]] = []  # (start, length, context_start, visible_context)
        fact_slices: list[tuple[FactSpec, int, tuple[int, ...]]] = []
        for group in groups:
            context_start = len(input_ids)
            input_ids.extend(group.context_ids)
            positions.extend(range(len(group.context_ids)))
            blocks.append((context_start, len(group.context_ids), context_start, 0))
            for fact in group.facts:
                if not 0 <= fact.prefix_length <= len(group.context_ids):
                    raise ValueError(f"{fact.key}: prefix {fact.prefix_length} outside its context")
                start = len(input_ids)
                input_ids.extend(fact.token_ids)
                positions.extend(range(fact.prefix_length, fact.prefix_length + len(fact.token_ids)))
                blocks.append((start, len(fact.token_ids), context_start, fact.prefix_length))
                fact_slices.append((fact, start, tuple(group.context_ids[: fact.prefix_length])))

        length = len(input_ids)
        allowed = torch.zeros(length, length, dtype=torch.bool)
        for start, size, context_start, visible in blocks:
            allowed[start : start + size, start : start + size] = torch.ones(size, size, dtype=torch.bool).tril()
            if visible:
                allowed[start : start + size, context_start : context_start + visible] = True
        mask = torch.zeros(length, length, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

        capture = _KvCapture(self.model)
        try:
            with torch.no_grad():
                self.model(
                    input_ids=torch.tensor([input_ids], device=self.device),
                    position_ids=torch.tensor([positions], device=self.device),
                    attention_mask=mask[None, None].to(self.device),
                    use_cache=False,
                )
        finally:
            capture.close()
        shape = (length, self.num_kv_heads, self.head_dim)
        keys = capture.stacked(capture.keys, shape)  # [L, S, H, D]
        values = capture.stacked(capture.values, shape)
        return [
            EncodedFact(
                spec=fact,
                keys=keys[:, start : start + len(fact.token_ids)].clone(),
                values=values[:, start : start + len(fact.token_ids)].clone(),
                context_ids=context_ids,
            )
            for fact, start, context_ids in fact_slices
        ]
