"""Fused Triton compose vs the torch path on the GPU: same numbers, and the time of each at serving shapes.

    python -m benchmarks.compose_check [--k 10 50] [--tokens-per-fact 30] [--dtype bfloat16]

Llama-3-8B KV shape (32 layers, 8 KV heads, 128 dims, llama3 rope scaling), chunks as the node cache holds them.
Reports max |fused - torch| against a float32 reference and the median time of each path (CUDA events); then
the connector's two ways of writing a load into vLLM's paged caches (FlashAttention NHD layout, shuffled block
table): `compose_into_cache` (one launch) vs fused compose + vLLM's `reshape_and_cache_flash` per layer (the
backend's own cache update), which must leave bit-identical caches.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig

from benchmarks.dummy_model import LLAMA3_8B
from inference_node.connector.compose import (
    ChunkSlice,
    PagedCaches,
    PagedLoad,
    compose_into_cache,
    compose_prefix,
)
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


def llama3_8b_config() -> LlamaConfig:
    return LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type")})


def kv_dims(config: LlamaConfig) -> tuple[int, int, int]:
    """Layers, KV heads and head dim (typed optional in LlamaConfig, always set by its constructor)."""
    assert config.num_key_value_heads is not None and config.head_dim is not None
    return config.num_hidden_layers, config.num_key_value_heads, config.head_dim


def rotary_tables(config: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the connector keeps them: float32, contiguous, on `device`."""
    tables = RotaryTables.from_config(config, 8192, device)
    return tables.cos.float().contiguous(), tables.sin.float().contiguous()


def random_chunks(config: LlamaConfig, lengths: list[int], device: torch.device,
                  dtype: torch.dtype) -> list[ChunkSlice]:
    """One whole chunk of random K/V per length, shaped as the node cache holds them."""
    layers, kv_heads, head_dim = kv_dims(config)
    return [ChunkSlice(torch.randn(layers, n, kv_heads, head_dim, device=device, dtype=dtype),
                       torch.randn(layers, n, kv_heads, head_dim, device=device, dtype=dtype), 0, n) for n in lengths]


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
    config = llama3_8b_config()
    cos, sin = rotary_tables(config, device)
    layers = config.num_hidden_layers
    start = 0
    print(f"{'k':>4}{'tokens':>8}{'max|fused-ref|':>16}{'max|torch-ref|':>16}{'fused ms':>10}{'torch ms':>10}")
    for k in args.k:
        lengths = [args.header_tokens] + [args.tokens_per_fact] * k
        slices = random_chunks(config, lengths, device, dtype)
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
        check_cache_writes(slices, cos, sin, layers)


def check_cache_writes(slices: list[ChunkSlice], cos: torch.Tensor, sin: torch.Tensor, layers: int,
                       block_size: int = 16, start: int = 0) -> None:
    from vllm._custom_ops import reshape_and_cache_flash

    sample = slices[0].keys
    _, _, heads, head_dim = sample.shape
    count = sum(s.end - s.begin for s in slices)
    blocks = -(-count // block_size) + 8
    block_ids = tuple(torch.randperm(blocks)[: -(-count // block_size)].tolist())

    def empty_caches() -> list[torch.Tensor]:  # vLLM's FlashAttention layout: physical NHD, logical [B, H, N, 2D]
        return [torch.zeros(blocks, block_size, heads, 2 * head_dim, device=sample.device,
                            dtype=sample.dtype).transpose(1, 2) for _ in range(layers)]

    fused_caches, backend_caches = empty_caches(), empty_caches()
    target = PagedCaches(fused_caches, block_size)
    load = PagedLoad(slices, start, block_ids)
    assert target.writable_by_kernel(sample.dtype)
    scale = torch.ones((), device=sample.device, dtype=torch.float32)
    positions = torch.arange(start, start + count)
    slots = (torch.tensor(block_ids)[positions // block_size] * block_size + positions % block_size).to(sample.device)

    def backend_write() -> None:
        keys, values = compose_prefix(slices, start, cos, sin, layers, fused=True)
        for layer, cache in enumerate(backend_caches):
            key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
            reshape_and_cache_flash(keys[layer], values[layer], key_cache, value_cache, slots, "auto", scale, scale)

    compose_into_cache([load], cos, sin, target)
    backend_write()
    identical = all(torch.equal(a, b) for a, b in zip(fused_caches, backend_caches, strict=True))
    into_ms = median_ms(lambda: compose_into_cache([load], cos, sin, target))
    backend_ms = median_ms(backend_write)
    print(f"     paged cache write, {count} tokens: compose_into_cache {into_ms:.3f} ms vs compose + "
          f"{layers} x reshape_and_cache_flash {backend_ms:.3f} ms; caches bit-identical: {identical}")
    assert identical, "compose_into_cache wrote different bytes than the backend's cache update"


if __name__ == "__main__":
    main()
