"""`python -m benchmarks.synthetic_worker [precompute_worker flags]`: a precompute worker whose fact KV is random.

Speed runs only (dummy-weight models, said so in every report that uses it): everything but the model's forward
is the real worker (lease, grouping, token ids, blob encoding, upload), and the KV has the model's shape.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Sequence

import torch

from inferscale_kv.shape import KvShape
from precompute_worker.__main__ import main
from precompute_worker.encoder import DTYPES, EncodedFact, EncodingGroup, FactSpec


class SyntheticFactEncoder:
    """The FactEncoder interface, with random pre-RoPE keys and values of the model's shape: slices of one bank of
    random numbers made once (tens of GB of fact KV for a throughput run would otherwise take minutes of
    random-number generation), at offsets drawn from what the fact's KV depends on (its context, its tokens, how much
    of the context it attends to). So every synthetic worker computes the same KV for the same fact, as real ones do,
    and the service's header checks and KV audits pass among them."""

    def __init__(self, config, dtype: torch.dtype, max_tokens_per_forward: int, seed: int = 0,
                 bank_elements: int = 1 << 25) -> None:
        self.max_tokens_per_forward = max_tokens_per_forward
        self._shape = KvShape.from_config(config)
        self._bank = torch.randn(bank_elements, generator=torch.Generator().manual_seed(seed)).mul_(0.5).to(dtype)

    def _slice(self, shape: tuple[int, ...], part: str, context_ids: Sequence[int], spec: FactSpec) -> torch.Tensor:
        count = math.prod(shape)
        if count > self._bank.numel():
            raise ValueError(f"a fact of {count} KV elements is larger than the random bank")
        material = repr((part, spec.prefix_length, list(context_ids[: spec.prefix_length]), spec.token_ids))
        offset = int.from_bytes(hashlib.blake2b(material.encode(), digest_size=8).digest(), "little")
        offset %= self._bank.numel() - count + 1
        return self._bank[offset : offset + count].view(shape)

    def encode(self, groups: Sequence[EncodingGroup]) -> list[EncodedFact]:
        encoded = []
        for group in groups:
            for spec in group.facts:
                shape = self._shape.of(len(spec.token_ids))
                encoded.append(EncodedFact(spec, self._slice(shape, "keys", group.context_ids, spec),
                                           self._slice(shape, "values", group.context_ids, spec)))
        return encoded


def synthetic_encoder(args, model_dir) -> SyntheticFactEncoder:
    from transformers import AutoConfig

    return SyntheticFactEncoder(AutoConfig.from_pretrained(model_dir), DTYPES[args.dtype], args.max_tokens_per_forward)


if __name__ == "__main__":
    sys.exit(main(encoder_factory=synthetic_encoder))
