"""`python -m benchmarks.synthetic_worker [precompute_worker flags]`: a precompute worker whose fact KV is random.

Speed runs only (dummy-weight models, said so in every report that uses it): everything but the model's forward
is the real worker (lease, grouping, token ids, blob encoding, upload), and the KV has the model's shape.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from inferscale_kv.shape import KvShape
from precompute_worker.__main__ import main
from precompute_worker.encoder import DTYPES, EncodedFact, EncodingGroup


class SyntheticFactEncoder:
    """The FactEncoder interface, with random pre-RoPE keys and values of the model's shape: slices at random
    offsets of one bank of random numbers made once (tens of GB of fact KV for a throughput run would otherwise
    take minutes of random-number generation)."""

    def __init__(self, config, dtype: torch.dtype, max_tokens_per_forward: int, seed: int = 0,
                 bank_elements: int = 1 << 25) -> None:
        self.max_tokens_per_forward = max_tokens_per_forward
        self._generator = torch.Generator().manual_seed(seed)
        self._shape = KvShape.from_config(config)
        self._bank = torch.randn(bank_elements, generator=self._generator).mul_(0.5).to(dtype)

    def _random(self, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for size in shape:
            count *= size
        if count > self._bank.numel():
            raise ValueError(f"a fact of {count} KV elements is larger than the random bank")
        offset = int(torch.randint(0, self._bank.numel() - count + 1, (1,), generator=self._generator))
        return self._bank[offset : offset + count].view(shape)

    def encode(self, groups: Sequence[EncodingGroup]) -> list[EncodedFact]:
        encoded = []
        for group in groups:
            for spec in group.facts:
                shape = self._shape.of(len(spec.token_ids))
                encoded.append(EncodedFact(spec, self._random(shape), self._random(shape)))
        return encoded


def synthetic_encoder(args, model_dir) -> SyntheticFactEncoder:
    from transformers import AutoConfig

    return SyntheticFactEncoder(AutoConfig.from_pretrained(model_dir), DTYPES[args.dtype], args.max_tokens_per_forward)


if __name__ == "__main__":
    sys.exit(main(encoder_factory=synthetic_encoder))
