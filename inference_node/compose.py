"""Compose a request's memory prefix: gather its chunks' pre-RoPE KV and rotate the keys to their final positions.

`compose_prefix` is the one entry point. On CUDA it runs one fused Triton kernel over every layer, token and
head (gather from the node cache's entries through a pointer table, rotate-half RoPE in float32 with the
model's own tables, one rounding to the model dtype); elsewhere it runs the same arithmetic with torch ops.
Both return contiguous `[layers, tokens, kv_heads, head_dim]` keys (post-RoPE) and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferscale_kv.rope import apply_rope

try:  # Triton ships with vLLM's CUDA and CPU builds; the fused path is used only on CUDA devices.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None


@dataclass(frozen=True)
class ChunkSlice:
    """Tokens [begin, end) of one cached chunk (`keys`/`values`: [layers, chunk_tokens, kv_heads, head_dim])."""

    keys: torch.Tensor
    values: torch.Tensor
    begin: int
    end: int


def compose_prefix(slices: list[ChunkSlice], start: int, cos: torch.Tensor, sin: torch.Tensor,
                   num_layers: int, *, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys rotated to positions start, start + 1, ... and values, concatenated in slice order.

    `cos`/`sin` are the model's rotary tables `[max_positions, head_dim]` in float32 on the slices' device; `fused`
    forces (True) or avoids (False) the Triton kernel, default: fused on CUDA.
    """
    if fused is None:
        fused = triton is not None and slices[0].keys.is_cuda
    if fused:
        return _compose_triton(slices, start, cos, sin, num_layers)
    keys = torch.cat([s.keys[:num_layers, s.begin : s.end] for s in slices], dim=1)
    values = torch.cat([s.values[:num_layers, s.begin : s.end] for s in slices], dim=1)
    count = keys.shape[1]
    rotated = apply_rope(keys, 0, cos[start : start + count].to(keys.dtype), sin[start : start + count].to(keys.dtype))
    return rotated, values.contiguous()


def _compose_triton(slices: list[ChunkSlice], start: int, cos: torch.Tensor, sin: torch.Tensor,
                    num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    sample = slices[0].keys
    _, _, heads, head_dim = sample.shape
    device, dtype = sample.device, sample.dtype
    lengths = [s.end - s.begin for s in slices]
    count = sum(lengths)
    # Per token: which chunk, and which row of that chunk's tensor. Built on the host, sent in one copy.
    chunk_of_token = torch.repeat_interleave(torch.arange(len(slices), dtype=torch.int32),
                                             torch.tensor(lengths))
    row_of_token = torch.cat([torch.arange(s.begin, s.end, dtype=torch.int32) for s in slices])
    table = torch.tensor([[s.keys.data_ptr() for s in slices], [s.values.data_ptr() for s in slices],
                          [s.keys.shape[1] for s in slices]], dtype=torch.int64)
    host = torch.cat([table.flatten(), chunk_of_token.long(), row_of_token.long()])
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    chunks = len(slices)
    key_ptrs, value_ptrs, chunk_rows = packed[:chunks], packed[chunks : 2 * chunks], packed[2 * chunks : 3 * chunks]
    token_chunk, token_row = packed[3 * chunks : 3 * chunks + count], packed[3 * chunks + count :]
    keys = torch.empty((num_layers, count, heads, head_dim), device=device, dtype=dtype)
    values = torch.empty_like(keys)
    for s in slices:
        if not (s.keys.is_contiguous() and s.values.is_contiguous() and s.keys.dtype == dtype):
            raise ValueError("fused compose needs contiguous chunk tensors of one dtype")
    _rope_gather_kernel[(count, num_layers)](
        key_ptrs, value_ptrs, chunk_rows, token_chunk, token_row, cos, sin, keys, values, start, count,
        HEADS=heads, HALF=head_dim // 2, HEADS_POW2=triton.next_power_of_2(heads),
        HALF_POW2=triton.next_power_of_2(head_dim // 2), OUT_DTYPE=_TRITON_DTYPES[dtype])
    return keys, values


if triton is not None:
    _TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _rope_gather_kernel(key_ptrs, value_ptrs, chunk_rows, token_chunk, token_row, cos, sin, out_keys,
                            out_values, start, count, HEADS: tl.constexpr, HALF: tl.constexpr,
                            HEADS_POW2: tl.constexpr, HALF_POW2: tl.constexpr, OUT_DTYPE: tl.constexpr):
        token = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        chunk = tl.load(token_chunk + token)
        row = tl.load(token_row + token)
        rows = tl.load(chunk_rows + chunk)
        source_keys = tl.load(key_ptrs + chunk).to(tl.pointer_type(OUT_DTYPE))
        source_values = tl.load(value_ptrs + chunk).to(tl.pointer_type(OUT_DTYPE))
        heads = tl.arange(0, HEADS_POW2)[:, None]
        dims = tl.arange(0, HALF_POW2)[None, :]
        mask = (heads < HEADS) & (dims < HALF)
        inner = heads * (2 * HALF) + dims
        source = (layer * rows + row) * (HEADS * 2 * HALF) + inner
        target = (layer * count + token) * (HEADS * 2 * HALF) + inner
        first = tl.load(source_keys + source, mask=mask).to(tl.float32)
        second = tl.load(source_keys + source + HALF, mask=mask).to(tl.float32)
        position = (start + token).to(tl.int64) * (2 * HALF)
        cos_first = tl.load(cos + position + dims, mask=dims < HALF).to(tl.float32)
        cos_second = tl.load(cos + position + HALF + dims, mask=dims < HALF).to(tl.float32)
        sin_first = tl.load(sin + position + dims, mask=dims < HALF).to(tl.float32)
        sin_second = tl.load(sin + position + HALF + dims, mask=dims < HALF).to(tl.float32)
        tl.store(out_keys + target, (first * cos_first - second * sin_first).to(OUT_DTYPE), mask=mask)
        tl.store(out_keys + target + HALF, (second * cos_second + first * sin_second).to(OUT_DTYPE), mask=mask)
        tl.store(out_values + target, tl.load(source_values + source, mask=mask), mask=mask)
        tl.store(out_values + target + HALF, tl.load(source_values + source + HALF, mask=mask), mask=mask)
