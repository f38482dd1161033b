"""Prefix composition: gather + RoPE at the final positions, torch path and fused Triton kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from inference_node.connector.compose import ChunkSlice, PagedCaches, compose_into_cache, compose_prefix
from inferscale_kv.rope import apply_rope

LAYERS, HEADS, HEAD_DIM = 3, 2, 8


def _tables(positions: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.arange(positions)[:, None].float() * inverse
    embedding = torch.cat([angles, angles], dim=-1)
    return embedding.cos(), embedding.sin()


def _slices(seed: int = 0) -> list[ChunkSlice]:
    generator = torch.Generator().manual_seed(seed)
    chunks = [(torch.randn(LAYERS, 5, HEADS, HEAD_DIM, generator=generator),
               torch.randn(LAYERS, 5, HEADS, HEAD_DIM, generator=generator)) for _ in range(3)]
    return [ChunkSlice(*chunks[0], 0, 5), ChunkSlice(*chunks[1], 0, 5), ChunkSlice(*chunks[2], 1, 4)]


def test_torch_compose_rotates_the_concatenated_chunks_to_contiguous_positions() -> None:
    slices = _slices()
    cos, sin = _tables()
    keys, values = compose_prefix(slices, 7, cos, sin, LAYERS, fused=False)
    pre = torch.cat([s.keys[:, s.begin : s.end] for s in slices], dim=1)
    assert torch.equal(keys, apply_rope(pre, 7, cos, sin))
    assert torch.equal(values, torch.cat([s.values[:, s.begin : s.end] for s in slices], dim=1))
    assert keys.shape == (LAYERS, 13, HEADS, HEAD_DIM)


FUSED_CHECK = """
import torch
from tests.inference_node.test_compose import LAYERS, _slices, _tables
from inference_node.connector.compose import compose_prefix
slices, (cos, sin) = _slices(1), _tables()
fused = compose_prefix(slices, 11, cos, sin, LAYERS, fused=True)
plain = compose_prefix(slices, 11, cos, sin, LAYERS, fused=False)
print((fused[0] - plain[0]).abs().max().item(), (fused[1] - plain[1]).abs().max().item())
"""


def test_fused_triton_kernel_equals_the_torch_path() -> None:
    """The CUDA kernel's code, run by Triton's interpreter on the CPU (TRITON_INTERPRET applies at import)."""
    result = subprocess.run([sys.executable, "-c", FUSED_CHECK], capture_output=True, text=True, timeout=600,
                            check=False, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    key_error, value_error = map(float, result.stdout.split())
    assert key_error <= 1e-5 and value_error == 0.0


PAGED_CHECK = """
import torch
from tests.inference_node.test_compose import (BLOCK_IDS, BLOCK_SIZE, LAYERS, _empty_cache, _slices, _tables,
                                               _write_slots)
from inference_node.connector.compose import PagedCaches, compose_into_cache
slices, (cos, sin) = _slices(2), _tables()
for physical in ("NHD", "HND"):
    caches = [_empty_cache(physical) for _ in range(LAYERS)]
    expected = [cache.clone() for cache in caches]
    target = PagedCaches(caches, BLOCK_IDS, BLOCK_SIZE)
    compose_into_cache(slices, 3, cos, sin, target)
    _write_slots(slices, 3, cos, sin, PagedCaches(expected, target.block_ids, target.block_size))
    same_slots = all(torch.equal(got.isnan(), want.isnan()) for got, want in zip(caches, expected))
    print(max((got - want).nan_to_num().abs().max().item() for got, want in zip(caches, expected)) if same_slots
          else "inf")
"""


BLOCK_IDS, BLOCK_SIZE, BLOCKS = (5, 2, 7, 0), 4, 8


def _empty_cache(physical: str) -> torch.Tensor:
    """A layer cache in vLLM's logical layout [blocks, heads, block_size, 2 * head_dim], NaN-filled."""
    if physical == "NHD":
        return torch.full((BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_DIM), float("nan")).transpose(1, 2)
    return torch.full((BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM), float("nan"))


def _write_slots(slices: list[ChunkSlice], start: int, cos: torch.Tensor, sin: torch.Tensor,
                 caches: PagedCaches) -> None:
    """The reference: torch compose, then every token written to its slot one by one."""
    keys, values = compose_prefix(slices, start, cos, sin, LAYERS, fused=False)
    for token in range(keys.shape[1]):
        position = start + token
        block, slot = caches.block_ids[position // caches.block_size], position % caches.block_size
        for layer, cache in enumerate(caches.layers):
            cache[block, :, slot, :HEAD_DIM] = keys[layer, token]
            cache[block, :, slot, HEAD_DIM:] = values[layer, token]


def test_fused_kernel_writes_the_composed_prefix_into_paged_caches_of_either_physical_layout() -> None:
    """compose_into_cache (Triton interpreter) == torch compose + slot-by-slot writes; untouched slots stay NaN."""
    result = subprocess.run([sys.executable, "-c", PAGED_CHECK], capture_output=True, text=True, timeout=600,
                            check=False, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [float(line) for line in result.stdout.split()]
    assert len(errors) == 2 and all(error <= 1e-5 for error in errors), errors


def test_fused_cache_write_refuses_a_block_table_that_does_not_cover_the_tokens() -> None:
    caches = PagedCaches([_empty_cache("HND") for _ in range(LAYERS)], (5, 2), 4)
    with pytest.raises(ValueError, match="do not cover"):
        compose_into_cache(_slices(), 3, *_tables(), caches)
