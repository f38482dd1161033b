"""Fused Triton compose vs the torch path on the GPU: same numbers, and the time of each at serving shapes.

    python -m benchmarks.compose_check [--k 10 50] [--tokens-per-fact 30] [--dtype bfloat16]

Llama-3-8B KV shape (32 layers, 8 KV heads, 128 dims, llama3 rope scaling), chunks as the node cache holds them.
Reports max |fused - torch| against a float32 reference and the median time of each path (CUDA events).
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig

from benchmarks.dummy_model import LLAMA3_8B
from inference_node.compose import ChunkSlice, compose_prefix
from inferscale_kv.rope import RotaryTables


def median_ms(run, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--tokens-per-fact", type=int, default=30)
    parser.add_argument("--header-tokens", type=int, default=40)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compose_check: needs a CUDA device (the CPU path is covered by the tests)")
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    config = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type")})
    tables = RotaryTables.from_config(config, 8192, device)
    cos, sin = tables.cos.float().contiguous(), tables.sin.float().contiguous()
    layers, heads, head_dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    print(f"{'k':>4}{'tokens':>8}{'max|fused-ref|':>16}{'max|torch-ref|':>16}{'fused ms':>10}{'torch ms':>10}")
    for k in args.k:
        lengths = [args.header_tokens] + [args.tokens_per_fact] * k
        slices = [ChunkSlice(torch.randn(layers, n, heads, head_dim, device=device, dtype=dtype),
                             torch.randn(layers, n, heads, head_dim, device=device, dtype=dtype), 0, n)
                  for n in lengths]
        start = 0
        reference = compose_prefix([ChunkSlice(s.keys.float(), s.values.float(), s.begin, s.end) for s in slices],
                                   start, cos, sin, layers, fused=False)
        fused = compose_prefix(slices, start, cos, sin, layers, fused=True)
        plain = compose_prefix(slices, start, cos, sin, layers, fused=False)
        assert torch.equal(fused[1], plain[1]), "values differ"
        fused_error = (fused[0].float() - reference[0]).abs().max().item()
        plain_error = (plain[0].float() - reference[0]).abs().max().item()
        fused_ms = median_ms(lambda slices=slices: compose_prefix(slices, start, cos, sin, layers, fused=True))
        plain_ms = median_ms(lambda slices=slices: compose_prefix(slices, start, cos, sin, layers, fused=False))
        print(f"{k:>4}{sum(lengths):>8}{fused_error:>16.3e}{plain_error:>16.3e}{fused_ms:>10.3f}{plain_ms:>10.3f}")


if __name__ == "__main__":
    main()
