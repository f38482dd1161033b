"""Compose a request's memory prefix: gather its chunks' pre-RoPE KV and rotate the keys to their final positions.

`compose_prefix` returns contiguous `[layers, tokens, kv_heads, head_dim]` keys (post-RoPE) and values. On CUDA
it runs one fused Triton kernel over every layer, token and head (gather from the node cache's entries through a
pointer table, rotate-half RoPE in float32 with the model's own tables, one rounding to the model dtype);
elsewhere the same arithmetic with torch ops. `compose_into_cache` is the same kernel writing straight into
vLLM's paged KV caches through each request's block table (CUDA, cache dtype = model dtype): one launch for every
load of an engine step, no intermediate tensors, no per-layer cache-update launches. `compose_for_slots` is its
torch counterpart: the step's loads composed together, with each token's cache slot, for the backends' own
per-layer cache updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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

    def __post_init__(self) -> None:
        """Bounds every read the kernels make: a slice never reaches past its chunk's rows."""
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise ValueError(f"chunk keys {tuple(self.keys.shape)} / values {tuple(self.values.shape)}: "
                             "want one [layers, tokens, kv_heads, head_dim] shape")
        if not 0 <= self.begin < self.end <= self.keys.shape[1]:
            raise ValueError(f"slice [{self.begin}, {self.end}) outside the chunk's {self.keys.shape[1]} rows")


def compose_prefix(slices: list[ChunkSlice], start: int, cos: torch.Tensor, sin: torch.Tensor,
                   num_layers: int, *, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys rotated to positions start, start + 1, ... and values, concatenated in slice order.

    `cos`/`sin` are the model's rotary tables `[max_positions, head_dim]` in float32 on the slices' device; `fused`
    forces (True) or avoids (False) the Triton kernel, default: fused on CUDA.
    """
    _check_slices(slices, start + sum(s.end - s.begin for s in slices), cos)
    if fused is None:
        fused = triton is not None and slices[0].keys.is_cuda
    if fused:
        return _compose_triton(slices, start, cos, sin, num_layers)
    keys = torch.cat([s.keys[:num_layers, s.begin : s.end] for s in slices], dim=1)
    values = torch.cat([s.values[:num_layers, s.begin : s.end] for s in slices], dim=1)
    count = keys.shape[1]
    rotated = apply_rope(keys, 0, cos[start : start + count].to(keys.dtype), sin[start : start + count].to(keys.dtype))
    return rotated, values.contiguous()


def _check_slices(slices: list[ChunkSlice], end: int, cos: torch.Tensor) -> None:
    if not slices or any(s.keys.shape[2:] != slices[0].keys.shape[2:] for s in slices):
        raise ValueError("chunks of one load must share [kv_heads, head_dim]")
    if end > cos.shape[0]:
        raise ValueError(f"positions up to {end} exceed the rotary tables' {cos.shape[0]}")


@dataclass(frozen=True)
class PagedLoad:
    """One request's load: its slices in prompt order, composed at positions start, start + 1, ..., and the
    request's block ids (position p goes to slot p % block_size of block block_ids[p // block_size])."""

    slices: list[ChunkSlice]
    start: int
    block_ids: tuple[int, ...]

    @property
    def count(self) -> int:
        return sum(s.end - s.begin for s in self.slices)

    def slots(self, block_size: int) -> np.ndarray:
        """Each token's cache slot (block id * block_size + offset in the block), in load order; ValueError where
        the block ids do not cover the positions."""
        positions = np.arange(self.start, self.start + self.count, dtype=np.int64)
        if len(self.block_ids) * block_size < self.start + self.count:
            raise ValueError(f"{len(self.block_ids)} blocks of {block_size} do not cover tokens "
                             f"[{self.start}, {self.start + self.count})")
        return np.asarray(self.block_ids, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class PagedCaches:
    """Where loads go: each layer's paged cache in vLLM's logical layout `[blocks, kv_heads, block_size,
    2 * head_dim]` (K then V in the last dim; any physical order with a unit last stride, the same for every
    layer)."""

    layers: list[torch.Tensor]
    block_size: int

    def writable_by_kernel(self, dtype: torch.dtype) -> bool:
        first = self.layers[0]
        return (triton is not None and first.is_cuda and first.dim() == 4 and first.stride(-1) == 1
                and all(cache.dtype == dtype and cache.stride() == first.stride() for cache in self.layers))


def _checked_slots(loads: Sequence[PagedLoad], cos: torch.Tensor, block_size: int,
                   layers: int) -> tuple[list[ChunkSlice], np.ndarray, np.ndarray]:
    """Every load's slices, then each token's position and cache slot, in load order; ValueError for a load whose
    chunks or blocks do not cover its tokens, or whose chunks differ from the others in shape or dtype."""
    if not loads:
        raise ValueError("no loads to write")
    for load in loads:
        _check_slices(load.slices, load.start + load.count, cos)
        if min(s.keys.shape[0] for s in load.slices) < layers:
            raise ValueError(f"chunk layers do not cover the caches' {layers} layers")
    slices = [s for load in loads for s in load.slices]
    _check_slices(slices, 0, cos)
    positions = np.concatenate([np.arange(load.start, load.start + load.count, dtype=np.int64) for load in loads])
    return slices, positions, np.concatenate([load.slots(block_size) for load in loads])


def compose_into_cache(loads: Sequence[PagedLoad], cos: torch.Tensor, sin: torch.Tensor,
                       caches: PagedCaches) -> None:
    """Writes what `compose_prefix` returns for each load into the caches at the load's positions and blocks, every
    load in one launch. Caller checks `caches.writable_by_kernel`."""
    first = caches.layers[0]
    slices, positions, slots = _checked_slots(loads, cos, caches.block_size, len(caches.layers))
    _, _, heads, head_dim = slices[0].keys.shape
    if (first.shape[1], first.shape[3]) != (heads, 2 * head_dim) or slices[0].keys.dtype != first.dtype:
        raise ValueError(f"chunk KV [{heads} heads x {head_dim}] {slices[0].keys.dtype} does not fit caches of shape "
                         f"{tuple(first.shape)} {first.dtype}")
    if slots.min() < 0 or slots.max() >= first.shape[0] * caches.block_size:
        raise ValueError(f"slots outside the caches' {first.shape[0]} blocks")
    cache_ptrs = torch.tensor([cache.data_ptr() for cache in caches.layers], dtype=torch.int64)
    tables = _index_tables(slices, first.device, torch.from_numpy(positions), cache_ptrs, torch.from_numpy(slots))
    _rope_gather_kernel[(len(positions), len(caches.layers))](
        *tables[:6], cos, sin, tables[6], tables[7], tables[7], len(positions), *first.stride()[:3],
        HEADS=first.shape[1], HALF=first.shape[3] // 4, HEADS_POW2=triton.next_power_of_2(first.shape[1]),
        HALF_POW2=triton.next_power_of_2(first.shape[3] // 4), OUT_DTYPE=_TRITON_DTYPES[slices[0].keys.dtype],
        BLOCK_SIZE=caches.block_size, PAGED=True)


def compose_for_slots(loads: Sequence[PagedLoad], cos: torch.Tensor, sin: torch.Tensor, num_layers: int,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path of `compose_into_cache`: keys rotated to each token's position and values,
    `[layers, tokens, kv_heads, head_dim]` for the tokens of every load in load order, and each token's cache slot
    (int64, on the host). The same values `compose_prefix` gives each load alone, bit for bit."""
    slices, positions, slots = _checked_slots(loads, cos, block_size, num_layers)
    keys = torch.cat([s.keys[:num_layers, s.begin : s.end] for s in slices], dim=1)
    values = torch.cat([s.values[:num_layers, s.begin : s.end] for s in slices], dim=1)
    rows = torch.from_numpy(positions).to(cos.device)
    rotated = apply_rope(keys, 0, cos[rows].to(keys.dtype), sin[rows].to(keys.dtype))
    return rotated, values.contiguous(), torch.from_numpy(slots)


def _compose_triton(slices: list[ChunkSlice], start: int, cos: torch.Tensor, sin: torch.Tensor,
                    num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    sample = slices[0].keys
    _, _, heads, head_dim = sample.shape
    count = sum(s.end - s.begin for s in slices)
    positions = torch.arange(start, start + count, dtype=torch.int64)
    tables = _index_tables(slices, sample.device, positions)
    keys = torch.empty((num_layers, count, heads, head_dim), device=sample.device, dtype=sample.dtype)
    values = torch.empty_like(keys)
    _rope_gather_kernel[(count, num_layers)](
        *tables, cos, sin, keys, values, tables[5], count, 0, 0, 0,
        HEADS=heads, HALF=head_dim // 2, HEADS_POW2=triton.next_power_of_2(heads),
        HALF_POW2=triton.next_power_of_2(head_dim // 2), OUT_DTYPE=_TRITON_DTYPES[sample.dtype], BLOCK_SIZE=1,
        PAGED=False)
    return keys, values


def _index_tables(slices: list[ChunkSlice], device: torch.device, *extra: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's int64 index tables on `device`, built on the host and sent in one copy: per chunk its K and V
    pointers and row count, per token its chunk and row, then `extra` (host tensors: per token its position, then
    for paged writes the cache pointer per layer and per token its slot).
    Each table starts 16-byte aligned, so Triton's pointer-alignment specialization never changes between
    loads (a changed alignment would compile a new kernel variant mid-serving). Built with numpy in a few vector
    operations: per-slice torch calls made host time the larger part of a load (benchmarks/RESULTS.md, "The node's
    crossover policy and the connector's own time")."""
    dtype = slices[0].keys.dtype
    for s in slices:
        if not (s.keys.is_contiguous() and s.values.is_contiguous() and s.keys.dtype == dtype == s.values.dtype):
            raise ValueError("fused compose needs contiguous chunk tensors of one dtype")
    begins = np.fromiter((s.begin for s in slices), dtype=np.int64, count=len(slices))
    lengths = np.fromiter((s.end for s in slices), dtype=np.int64, count=len(slices)) - begins
    firsts = np.cumsum(lengths) - lengths  # each slice's first token in the load
    token_chunk = np.repeat(np.arange(len(slices), dtype=np.int64), lengths)
    tables = [np.fromiter((s.keys.data_ptr() for s in slices), dtype=np.int64, count=len(slices)),
              np.fromiter((s.values.data_ptr() for s in slices), dtype=np.int64, count=len(slices)),
              np.fromiter((s.keys.shape[1] for s in slices), dtype=np.int64, count=len(slices)),
              token_chunk, np.arange(int(lengths.sum()), dtype=np.int64) - (firsts - begins)[token_chunk],
              *(table.numpy() for table in extra)]
    offsets = np.cumsum([0] + [-(-len(table) // 2) * 2 for table in tables])  # int64 elements: 2 per 16 bytes
    host = np.zeros(int(offsets[-1]), dtype=np.int64)
    for offset, table in zip(offsets[:-1], tables, strict=True):
        host[offset : offset + len(table)] = table
    packed = torch.from_numpy(host)
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    return [packed[int(offset) : int(offset) + len(table)] for offset, table in zip(offsets[:-1], tables, strict=True)]


if triton is not None:
    _TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    # Token counts change with every step: specializing on them (Triton does for ints divisible by 16 or equal to 1)
    # would stall serving while a new variant compiles.
    @triton.jit(do_not_specialize=["count"])
    def _rope_gather_kernel(key_ptrs, value_ptrs, chunk_rows, token_chunk, token_row, token_position, cos, sin,
                            out_keys, out_values, token_slot, count, stride_block, stride_head, stride_slot,
                            HEADS: tl.constexpr, HALF: tl.constexpr, HEADS_POW2: tl.constexpr,
                            HALF_POW2: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            PAGED: tl.constexpr):
        """One program per (token, layer); each token rotated to its own position. PAGED: out_keys holds each
        layer's cache pointer (out_values unused), token_slot each token's slot (block * BLOCK_SIZE + offset), and
        K/V land at block * stride_block + head * stride_head + offset * stride_slot (+ head_dim for V). Else
        out_keys/out_values are contiguous [layers, count, heads, head_dim] tensors (token_slot unused)."""
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
        position = tl.load(token_position + token)
        if PAGED:
            slot = tl.load(token_slot + token)
            key_target = tl.load(out_keys + layer).to(tl.pointer_type(OUT_DTYPE)) + (
                (slot // BLOCK_SIZE) * stride_block + heads * stride_head + (slot % BLOCK_SIZE) * stride_slot + dims)
            value_target = key_target + 2 * HALF
        else:
            offset = (layer * count + token) * (HEADS * 2 * HALF) + inner
            key_target = out_keys + offset
            value_target = out_values + offset
        first = tl.load(source_keys + source, mask=mask).to(tl.float32)
        second = tl.load(source_keys + source + HALF, mask=mask).to(tl.float32)
        table_row = position * (2 * HALF)
        cos_first = tl.load(cos + table_row + dims, mask=dims < HALF).to(tl.float32)
        cos_second = tl.load(cos + table_row + HALF + dims, mask=dims < HALF).to(tl.float32)
        sin_first = tl.load(sin + table_row + dims, mask=dims < HALF).to(tl.float32)
        sin_second = tl.load(sin + table_row + HALF + dims, mask=dims < HALF).to(tl.float32)
        tl.store(key_target, (first * cos_first - second * sin_first).to(OUT_DTYPE), mask=mask)
        tl.store(key_target + HALF, (second * cos_second + first * sin_second).to(OUT_DTYPE), mask=mask)
        tl.store(value_target, tl.load(source_values + source, mask=mask), mask=mask)
        tl.store(value_target + HALF, tl.load(source_values + source + HALF, mask=mask), mask=mask)
