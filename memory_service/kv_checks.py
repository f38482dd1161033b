"""What the service checks of the KV a worker uploads, in one place: a blob's header (checksum, field types, content id,
storage dtype, shape, token ids) and values, what it names (the profile's memory header, or the fact version it is
uploaded for), and whether it fits the profile's stored KV, each failure an InvalidArgument naming the field; how far
two workers' KV of the same chunk may differ; and the name KV is served under once other KV of the same fact version
was withdrawn. memory_service.validation calls it on the wire's messages, the KV pipeline on what it stores."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Sequence

import torch

from inferscale_kv.blob import CorruptKvBlob, FactKv, KvBlobHeader, decode_kv_blob, encode_kv_blob, read_kv_header
from inferscale_kv.kv_key import header_key
from inferscale_kv.layout import token_hash
from inferscale_kv.profile import KV_DTYPES
from inferscale_kv.shape import KvShape
from memory_service.errors import InvalidArgument
from memory_service.models import AnnouncedProfile, KvUpload

# The largest relative difference (KvDifference) two honest computations of the same chunk may show, per storage dtype:
# a few times what two workers of the same model measured (benchmarks/RESULTS.md, "KV audit"), with bf16 and fp8 also
# admitting a bf16-computing worker beside a float32-computing one (the profile names the storage dtype only).
AUDIT_TOLERANCES = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 0.1, "fp8_e4m3": 0.15}
_TORCH_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CONTENT_ID = re.compile(r"[0-9a-f]{32}")
MAX_TOKEN_ID = 2**31  # token ids travel as int32 (RetrievedFact.token_ids)


def checked_upload(blob: bytes, field: str) -> KvUpload:
    """A blob whose checksum holds, whose header fields have their types and whose values are all finite, as an
    upload."""
    header = _checked_header(blob, field)
    return KvUpload(header.key, header.token_ids, blob, header.storage_dtype, header.kv_shape)


def _checked_header(blob: bytes, field: str) -> KvBlobHeader:
    try:
        header = read_kv_header(blob)
    except CorruptKvBlob as exc:
        raise InvalidArgument(field, str(exc)) from None
    except (KeyError, TypeError, ValueError, OverflowError):  # header fields of the wrong type or an unknown dtype
        raise InvalidArgument(field, "unreadable header (a field of the wrong type, or an unknown storage "
                              "dtype)") from None
    texts = (header.profile_id, header.user_id, header.fact_id, header.storage_dtype, header.content_id)
    numbers = (header.version, *header.shape, *header.token_ids)
    if not all(isinstance(text, str) for text in texts) or not all(
            isinstance(number, int) and not isinstance(number, bool) for number in numbers):
        raise InvalidArgument(field, "unreadable header (a field of the wrong type)")
    if not _CONTENT_ID.fullmatch(header.content_id):
        raise InvalidArgument(field, "content_id must be 32 lowercase hex digits (inferscale_kv.kv_key.content_id)")
    if header.storage_dtype not in KV_DTYPES:
        raise InvalidArgument(field, f"storage dtype {header.storage_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if min(header.shape) < 1 or len(header.token_ids) != header.num_tokens:
        raise InvalidArgument(field, f"shape {header.shape} with {len(header.token_ids)} token ids: every dimension "
                              "must be positive, with one token id per token")
    if not all(0 <= token < MAX_TOKEN_ID for token in header.token_ids):
        raise InvalidArgument(field, f"token ids must be in [0, {MAX_TOKEN_ID})")
    if non_finite_values(blob):
        raise InvalidArgument(field, "keys or values hold a NaN or an infinity")
    return header


def check_names_header(upload: KvUpload, profile: AnnouncedProfile, field: str) -> None:
    """A profile's memory header KV must name the profile's header, encoded behind nothing, whose token ids hash to
    the profile's header_hash (inferscale_kv.model_profile)."""
    expected = header_key(profile.profile_id, upload.token_ids)
    if upload.key != expected:
        raise InvalidArgument(field, f"must name {expected} (the profile's header, encoded behind nothing)")
    if token_hash(upload.token_ids) != profile.fields["header_hash"]:
        raise InvalidArgument(field, "its token ids are not the profile's memory header (their hash is not the "
                              "profile's header_hash)")


def check_names_fact(upload: KvUpload, profile_id: str, user_id: str, fact_id: str, version: int, field: str) -> None:
    """A fact's KV must name the profile, fact and version it is uploaded for."""
    key = upload.key
    if (key.profile_id, key.user_id, key.fact_id, key.version) != (profile_id, user_id, fact_id,
                                                                   version) or key.is_header:
        raise InvalidArgument(field, "header names another profile, fact or version")


def check_kv_fits_profile(upload: KvUpload, kv_dtype: str, shape: KvShape | None, field: str) -> None:
    """An upload's storage dtype must be the profile's, and its layout that of the KV already stored for the profile
    (`shape`; None: nothing stored yet)."""
    if upload.storage_dtype != kv_dtype:
        raise InvalidArgument(field, f"stored as {upload.storage_dtype}; the profile's kv_dtype is {kv_dtype}")
    if shape is not None and upload.shape != shape:
        raise InvalidArgument(field, f"{upload.shape.num_layers} layers x {upload.shape.num_kv_heads} KV heads x "
                              f"{upload.shape.head_dim} dims; the profile's stored KV has {shape.num_layers} x "
                              f"{shape.num_kv_heads} x {shape.head_dim}")


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
