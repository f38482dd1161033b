"""Prefix composition: gather + RoPE at the final positions, torch path and fused Triton kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from inference_node.connector.compose import (
    ChunkSlice,
    PagedCaches,
    PagedLoad,
    compose_for_slots,
    compose_into_cache,
    compose_prefix,
)
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
from tests.inference_node.test_compose import BLOCK_SIZE, LAYERS, _empty_cache, _loads, _tables, _write_slots
from inference_node.connector.compose import PagedCaches, compose_into_cache
loads, (cos, sin) = _loads(), _tables()
for physical in ("NHD", "HND"):
    caches = [_empty_cache(physical) for _ in range(LAYERS)]
    expected = [cache.clone() for cache in caches]
    compose_into_cache(loads, cos, sin, PagedCaches(caches, BLOCK_SIZE))
    for load in loads:
        _write_slots(load, cos, sin, PagedCaches(expected, BLOCK_SIZE))
    same_slots = all(torch.equal(got.isnan(), want.isnan()) for got, want in zip(caches, expected))
    print(max((got - want).nan_to_num().abs().max().item() for got, want in zip(caches, expected)) if same_slots
          else "inf")
"""


BLOCK_SIZE, BLOCKS = 4, 16


def _loads() -> list[PagedLoad]:
    """Three requests' loads of one engine step: mixed lengths, starts (one after a prefix-cache hit, inside a chunk)
    and block tables."""
    slices = _slices(2)
    return [PagedLoad(slices, 3, (5, 2, 7, 0)), PagedLoad(_slices(3), 0, (9, 1, 12, 3)),
            PagedLoad([ChunkSlice(slices[2].keys, slices[2].values, 2, 5)], 6, (11, 13, 15))]


def _empty_cache(physical: str) -> torch.Tensor:
    """A layer cache in vLLM's logical layout [blocks, heads, block_size, 2 * head_dim], NaN-filled."""
    if physical == "NHD":
        return torch.full((BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_DIM), float("nan")).transpose(1, 2)
    return torch.full((BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM), float("nan"))


def _write_slots(load: PagedLoad, cos: torch.Tensor, sin: torch.Tensor, caches: PagedCaches) -> None:
    """The reference: the load alone composed by torch, then every token written to its slot one by one."""
    keys, values = compose_prefix(load.slices, load.start, cos, sin, LAYERS, fused=False)
    for token in range(keys.shape[1]):
        position = load.start + token
        block, slot = load.block_ids[position // caches.block_size], position % caches.block_size
        for layer, cache in enumerate(caches.layers):
            cache[block, :, slot, :HEAD_DIM] = keys[layer, token]
            cache[block, :, slot, HEAD_DIM:] = values[layer, token]


def test_fused_kernel_writes_a_steps_loads_into_paged_caches_of_either_physical_layout() -> None:
    """compose_into_cache of three loads in one launch (Triton interpreter) == each load alone composed by torch and
    written slot by slot; untouched slots stay NaN."""
    result = subprocess.run([sys.executable, "-c", PAGED_CHECK], capture_output=True, text=True, timeout=600,
                            check=False, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [float(line) for line in result.stdout.split()]
    assert len(errors) == 2 and all(error <= 1e-5 for error in errors), errors


def test_fused_cache_write_refuses_a_block_table_that_does_not_cover_the_tokens() -> None:
    caches = PagedCaches([_empty_cache("HND") for _ in range(LAYERS)], 4)
    with pytest.raises(ValueError, match="do not cover"):
        compose_into_cache([_loads()[1], PagedLoad(_slices(), 3, (5, 2))], *_tables(), caches)


def test_torch_compose_of_a_steps_loads_is_each_load_composed_alone_bit_for_bit() -> None:
    loads, (cos, sin) = _loads(), _tables()
    keys, values, slots = compose_for_slots(loads, cos, sin, LAYERS, BLOCK_SIZE)
    first = 0
    for load in loads:
        alone_keys, alone_values = compose_prefix(load.slices, load.start, cos, sin, LAYERS, fused=False)
        count = alone_keys.shape[1]
        assert torch.equal(keys[:, first : first + count], alone_keys)
        assert torch.equal(values[:, first : first + count], alone_values)
        positions = range(load.start, load.start + count)
        assert slots[first : first + count].tolist() == [
            load.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        first += count
    assert first == keys.shape[1] == len(slots)
