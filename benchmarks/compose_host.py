"""Host wall time of the connector's paged-cache write on the GPU, part by part (the device synchronized before and
after each call): `compose_into_cache` in all, building its index tables, the kernel launch with tables ready.

    python -m benchmarks.compose_host [--k 1 10 50] [--tokens-per-fact 34] [--header-tokens 40]

Llama-3-8B KV shape, bf16, vLLM's FlashAttention cache layout. `compose_check` times the kernels on the device
(CUDA events); this times what the engine thread waits for, which is where small loads spend their time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig

from benchmarks.compose_check import kv_dims, llama3_8b_config, random_chunks, rotary_tables
from inference_node.connector import compose

BLOCK_SIZE, BLOCKS = 16, 4096


def wall_ms(run: Callable[[], object], repeats: int = 60, warm_up: int = 10) -> float:
    """Median host time of `run` from an idle device to the end of its device work."""
    times = []
    for _ in range(repeats + warm_up):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[warm_up:])


def time_load(config: LlamaConfig, lengths: list[int], caches: list[torch.Tensor], cos: torch.Tensor,
              sin: torch.Tensor, device: torch.device, dtype: torch.dtype) -> tuple[float, float, float]:
    """Wall ms of one load of chunks of `lengths` tokens: compose_into_cache, its index tables, the kernel launch."""
    layers, kv_heads, head_dim = kv_dims(config)
    slices = random_chunks(config, lengths, device, dtype)
    count = sum(lengths)
    target = compose.PagedCaches(caches, BLOCK_SIZE)
    load = compose.PagedLoad(slices, 0, tuple(torch.randperm(BLOCKS)[: -(-count // BLOCK_SIZE)].tolist()))
    pointers = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64)
    positions, slots = torch.arange(count, dtype=torch.int64), torch.from_numpy(load.slots(BLOCK_SIZE))
    tables = compose._index_tables(slices, device, positions, pointers, slots)
    first = caches[0]

    def launch() -> None:
        compose._rope_gather_kernel[(count, layers)](
            *tables[:6], cos, sin, tables[6], tables[7], tables[7], count, *first.stride()[:3], HEADS=kv_heads,
            HALF=head_dim // 2, HEADS_POW2=kv_heads, HALF_POW2=head_dim // 2,
            OUT_DTYPE=compose._TRITON_DTYPES[dtype], BLOCK_SIZE=BLOCK_SIZE, PAGED=True)

    whole = wall_ms(lambda: compose.compose_into_cache([load], cos, sin, target))
    building = wall_ms(lambda: compose._index_tables(slices, device, positions, pointers, slots))
    return whole, building, wall_ms(launch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--tokens-per-fact", type=int, default=34)
    parser.add_argument("--header-tokens", type=int, default=40)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("compose_host: needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    config = llama3_8b_config()
    layers, kv_heads, head_dim = kv_dims(config)
    cos, sin = rotary_tables(config, device)
    caches = [torch.zeros(BLOCKS, BLOCK_SIZE, kv_heads, 2 * head_dim, device=device, dtype=dtype).transpose(1, 2)
              for _ in range(layers)]
    print(f"{'k':>4}{'tokens':>8}{'compose_into_cache ms':>24}{'index tables ms':>18}{'launch ms':>12}")
    for k in args.k:
        lengths = [args.header_tokens] + [args.tokens_per_fact] * k
        whole, building, launch = time_load(config, lengths, caches, cos, sin, device, dtype)
        print(f"{k:>4}{sum(lengths):>8}{whole:>24.3f}{building:>18.3f}{launch:>12.3f}")


if __name__ == "__main__":
    main()
