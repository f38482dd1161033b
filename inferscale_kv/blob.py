"""The fact KV blob: one self-describing, checksummed byte string per KV key (inferscale_kv.kv_key).

Layout: b"ISKV" | u32 header length | u32 CRC-32 of everything after this field | header (JSON) | payload.
Payload: pre-RoPE keys then values, each [layers, tokens, kv_heads, head_dim] in the storage dtype; for
fp8_e4m3 storage, float32 scales [layers, 2 (K, V), kv_heads] follow (value = fp8 * scale).
A torn or corrupted blob fails the checksum and is never decoded into tensors.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from inferscale_kv.kv_key import KvKey
from inferscale_kv.shape import KvShape

MAGIC = b"ISKV"
_PREFIX = struct.Struct("<4sII")
Buffer = bytes | bytearray | memoryview  # what a blob may be read from in place
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CorruptKvBlob(ValueError):
    """The blob is truncated, fails its checksum, or its header does not match its payload."""


@dataclass(frozen=True)
class KvBlobHeader:
    profile_id: str
    user_id: str
    fact_id: str
    version: int
    storage_dtype: str
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    token_ids: tuple[int, ...]
    content_id: str  # kv_key.content_id of the context the chunk attended to and of token_ids

    @property
    def key(self) -> KvKey:
        return KvKey(self.profile_id, self.user_id, self.fact_id, self.version, self.content_id)

    @property
    def elements_per_tensor(self) -> int:
        return self.num_layers * self.num_tokens * self.num_kv_heads * self.head_dim

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def kv_shape(self) -> KvShape:
        return KvShape(self.num_layers, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class FactKv:
    """A fact's KV in compute form: pre-RoPE keys and values, [layers, tokens, kv_heads, head_dim]."""

    header: KvBlobHeader
    keys: torch.Tensor
    values: torch.Tensor


def _quantize_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, head) e4m3 quantization of [L, T, H, D]; returns (fp8 bits as uint8, scales [L, H])."""
    amax = tensor.float().abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (tensor.float() / scales[:, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.view(torch.uint8), scales


def encode_kv_blob(header: KvBlobHeader, keys: torch.Tensor, values: torch.Tensor) -> bytes:
    """Serializes pre-RoPE keys and values (any float dtype) in the header's storage dtype."""
    if tuple(keys.shape) != header.shape or tuple(values.shape) != header.shape:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match {header.shape}")
    if len(header.token_ids) != header.num_tokens:
        raise ValueError(f"{len(header.token_ids)} token ids for {header.num_tokens} tokens")
    if header.storage_dtype == "fp8_e4m3":
        key_bits, key_scales = _quantize_fp8(keys)
        value_bits, value_scales = _quantize_fp8(values)
        scales = torch.stack([key_scales, value_scales], dim=1).to(torch.float32).contiguous()
        parts = [key_bits.contiguous(), value_bits.contiguous(), scales]
    else:
        dtype = _TORCH_DTYPES[header.storage_dtype]
        parts = [keys.to(dtype).contiguous(), values.to(dtype).contiguous()]
    header_json = json.dumps({**header.__dict__, "token_ids": list(header.token_ids)}).encode()
    payload = b"".join(part.cpu().view(torch.uint8).numpy().tobytes() for part in parts)
    body = header_json + payload
    return _PREFIX.pack(MAGIC, len(header_json), zlib.crc32(body)) + body


def read_kv_header(blob: Buffer) -> KvBlobHeader:
    """Checks the blob's checksum and returns its header (any buffer: the checksum reads it in place)."""
    if len(blob) < _PREFIX.size:
        raise CorruptKvBlob("truncated before the header")
    magic, header_length, checksum = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptKvBlob("not a KV blob (bad magic)")
    body = memoryview(blob).cast("B")[_PREFIX.size :]
    if zlib.crc32(body) != checksum:
        raise CorruptKvBlob("checksum mismatch (torn or corrupted)")
    try:
        fields = json.loads(bytes(body[:header_length]))
        header = KvBlobHeader(**{**fields, "token_ids": tuple(fields["token_ids"])})
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptKvBlob(f"unreadable header: {exc}") from None
    if len(body) - header_length != payload_bytes(header):
        raise CorruptKvBlob("payload size does not match the header")
    return header


def payload_bytes(header: KvBlobHeader) -> int:
    if header.storage_dtype == "fp8_e4m3":
        return 2 * header.elements_per_tensor + 4 * header.num_layers * 2 * header.num_kv_heads
    return 2 * header.elements_per_tensor * _TORCH_DTYPES[header.storage_dtype].itemsize


def decode_kv_blob(blob: bytes, compute_dtype: torch.dtype = torch.float32) -> FactKv:
    """Checks and decodes a blob into keys and values of `compute_dtype` (fp8 is dequantized)."""
    header = read_kv_header(blob)
    _, header_length, _ = _PREFIX.unpack_from(blob)
    payload = torch.frombuffer(bytearray(blob[_PREFIX.size + header_length :]), dtype=torch.uint8)
    count = header.elements_per_tensor
    if header.storage_dtype == "fp8_e4m3":
        key_bits, value_bits, scale_bytes = payload[:count], payload[count : 2 * count], payload[2 * count :]
        scales = scale_bytes.view(torch.float32).view(header.num_layers, 2, header.num_kv_heads)
        keys = key_bits.view(torch.float8_e4m3fn).view(header.shape).float() * scales[:, 0, None, :, None]
        values = value_bits.view(torch.float8_e4m3fn).view(header.shape).float() * scales[:, 1, None, :, None]
    else:
        dtype = _TORCH_DTYPES[header.storage_dtype]
        tensors = payload.view(dtype)
        keys, values = tensors[:count].view(header.shape), tensors[count:].view(header.shape)
    return FactKv(header=header, keys=keys.to(compute_dtype), values=values.to(compute_dtype))


def decode_kv_heads(blob: Buffer, compute_dtype: torch.dtype, heads: slice | None = None,
                    pin_memory: bool = False, out: torch.Tensor | None = None) -> FactKv:
    """Checks a blob (checksum read in place, no copy) and decodes the KV heads `heads` (all when None) into one host
    buffer of `compute_dtype` that holds keys then values, each contiguous: `out` when given (contiguous, of shape
    [2, layers, tokens, heads, head_dim] and `compute_dtype`: CorruptKvBlob if the blob's shape is another), else a
    new one (pinned when `pin_memory`). When the storage dtype is `compute_dtype` the heads are copied once, straight
    from `blob` (which may be read-only, e.g. the bytes gRPC handed over) into that buffer, in native code: nothing
    per byte in Python. Other dtypes (fp8 among them) are decoded by `decode_kv_blob`, then sliced and copied."""
    header = read_kv_header(blob)
    first, last, _ = (heads or slice(None)).indices(header.num_kv_heads)
    shape = (2, header.num_layers, header.num_tokens, max(0, last - first), header.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=compute_dtype, pin_memory=pin_memory)
    elif tuple(out.shape) != shape or out.dtype != compute_dtype or not out.is_contiguous():
        raise CorruptKvBlob(f"a blob of KV {shape} where {tuple(out.shape)} {out.dtype} was expected")
    dtype = _TORCH_DTYPES.get(header.storage_dtype)
    if dtype == compute_dtype:
        view = memoryview(blob).cast("B")
        start = _PREFIX.size + _PREFIX.unpack_from(view)[1]
        row = header.head_dim * compute_dtype.itemsize
        source = np.frombuffer(view, dtype=np.uint8, offset=start).reshape(
            2, header.num_layers, header.num_tokens, header.num_kv_heads, row)
        np.copyto(out.view(torch.uint8).numpy(), source[:, :, :, first:last])
    else:
        kv = decode_kv_blob(bytes(blob), compute_dtype)
        out[0].copy_(kv.keys[:, :, first:last])
        out[1].copy_(kv.values[:, :, first:last])
    return FactKv(header=header, keys=out[0], values=out[1])
