"""Prefix composition: gather + RoPE at the final positions, torch path and fused Triton kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from inference_node.compose import ChunkSlice, compose_prefix
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
from inference_node.compose import compose_prefix
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
