"""What the service checks of the KV a worker uploads beyond its blob's checksum and key (memory_service.validation):
values, how far two workers' KV of the same chunk may differ, and the name KV is served under once other KV of the
same fact version was withdrawn."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import torch

from inferscale_kv.blob import FactKv, decode_kv_blob, encode_kv_blob, read_kv_header

# The largest relative difference (KvDifference) two honest computations of the same chunk may show, per storage dtype:
# a few times what two workers of the same model measured (benchmarks/RESULTS.md, "KV audit"), with bf16 and fp8 also
# admitting a bf16-computing worker beside a float32-computing one (the profile names the storage dtype only).
AUDIT_TOLERANCES = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 0.1, "fp8_e4m3": 0.15}
_TORCH_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def non_finite_values(blob: bytes) -> bool:
    """Whether the blob's keys or values (dequantized, for fp8) hold a NaN or an infinity."""
    kv = decode_kv_blob(blob)
    return not (bool(torch.isfinite(kv.keys).all()) and bool(torch.isfinite(kv.values).all()))


def kv_difference(reference: bytes, candidate: bytes) -> float:
    """How far `candidate`'s KV is from `reference`'s: the largest relative Frobenius distance over layers, keys and
    values (||a - b|| / max(||a||, ||b||)); infinite when they name another fact, version, tokens, dtype or shape
    (their content ids are the caller's to compare: see `served_content_id`)."""
    first, second = decode_kv_blob(reference), decode_kv_blob(candidate)
    if not _same_chunk(first, second):
        return math.inf
    worst = 0.0
    for a, b in ((first.keys, second.keys), (first.values, second.values)):
        norms = torch.maximum(a.flatten(1).norm(dim=1), b.flatten(1).norm(dim=1))
        distances = (a - b).flatten(1).norm(dim=1)
        relative = torch.where(norms > 0, distances / norms.clamp_min(torch.finfo(torch.float32).tiny),
                               torch.zeros_like(norms))
        worst = max(worst, float(relative.max()) if relative.numel() else 0.0)
    return worst


def _same_chunk(first: FactKv, second: FactKv) -> bool:
    a, b = first.header, second.header
    return ((a.profile_id, a.user_id, a.fact_id, a.version, a.token_ids, a.shape, a.storage_dtype)
            == (b.profile_id, b.user_id, b.fact_id, b.version, b.token_ids, b.shape, b.storage_dtype))


def served_content_id(computed: str, barred: Sequence[str]) -> str:
    """The content id KV computed under `computed` is stored and served under: the same, unless KV of that fact version
    was withdrawn before (`barred`: the workers barred from it since), so that no node cache holding the withdrawn
    bytes under their name can take them for these (one name never means other bytes)."""
    if not barred:
        return computed
    return hashlib.sha256(f"{computed}|withdrawn:{','.join(sorted(barred))}".encode()).hexdigest()[:32]


def with_content_id(blob: bytes, content_id: str) -> bytes:
    """The blob renamed to `content_id`, every other header field and its tensors unchanged (fp8 is dequantized and
    quantized again: the same codes, the scales at most a rounding apart)."""
    dtype = read_kv_header(blob).storage_dtype
    kv = decode_kv_blob(blob, _TORCH_STORAGE_DTYPES.get(dtype, torch.float32))
    return encode_kv_blob(dataclasses.replace(kv.header, content_id=content_id), kv.keys, kv.values)
