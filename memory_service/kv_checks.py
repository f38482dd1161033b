"""What the service checks of the KV a worker uploads beyond its blob's checksum and key (memory_service.validation):
values, dtype and shape against the profile, and how far two workers' KV of the same chunk may differ."""

from __future__ import annotations

import math

import torch

from inferscale_kv.blob import FactKv, decode_kv_blob

# The largest relative difference (KvDifference) two honest computations of the same chunk may show, per storage dtype:
# a few times what two workers of the same model measured (benchmarks/RESULTS.md, "KV audit"), with bf16 and fp8 also
# admitting a bf16-computing worker beside a float32-computing one (the profile names the storage dtype only).
AUDIT_TOLERANCES = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 1e-1, "fp8_e4m3": 1e-1}


def non_finite_values(blob: bytes) -> bool:
    """Whether the blob's keys or values (dequantized, for fp8) hold a NaN or an infinity."""
    kv = decode_kv_blob(blob)
    return not (bool(torch.isfinite(kv.keys).all()) and bool(torch.isfinite(kv.values).all()))


def kv_difference(reference: bytes, candidate: bytes) -> float:
    """How far `candidate`'s KV is from `reference`'s: the largest relative Frobenius distance over layers, keys and
    values (||a - b|| / max(||a||, ||b||)); infinite when they name other tokens, contexts or shapes."""
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
    return (a.key, a.token_ids, a.shape, a.storage_dtype) == (b.key, b.token_ids, b.shape, b.storage_dtype)
