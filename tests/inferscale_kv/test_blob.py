import pytest
import torch

from inferscale_kv.blob import CorruptKvBlob, KvBlobHeader, decode_kv_blob, encode_kv_blob, read_kv_header


def _header(dtype: str, tokens: int = 5) -> KvBlobHeader:
    return KvBlobHeader(profile_id="kvp-1", user_id="u", fact_id="f", version=2, storage_dtype=dtype, num_layers=3,
                        num_tokens=tokens, num_kv_heads=2, head_dim=8, token_ids=tuple(range(tokens)),
                        content_id="a" * 32)


def _tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, 2, 8, generator=generator), torch.randn(3, 5, 2, 8, generator=generator) * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_native_dtypes_round_trip_exactly_in_their_dtype(dtype: str) -> None:
    keys, values = _tensors()
    decoded = decode_kv_blob(encode_kv_blob(_header(dtype), keys, values))
    torch_dtype = getattr(torch, dtype)
    assert torch.equal(decoded.keys, keys.to(torch_dtype).float())
    assert torch.equal(decoded.values, values.to(torch_dtype).float())
    assert decoded.header == _header(dtype)


def test_fp8_round_trip_stays_within_e4m3_precision_and_quarters_the_bytes() -> None:
    keys, values = _tensors()
    fp8_blob = encode_kv_blob(_header("fp8_e4m3"), keys, values)
    decoded = decode_kv_blob(fp8_blob)
    for original, restored in ((keys, decoded.keys), (values, decoded.values)):
        relative = (original - restored).abs().max() / original.abs().max()
        assert relative < 0.07  # e4m3 has a 3-bit mantissa: ≤ 1/16 relative step at the scale's top
    native = encode_kv_blob(_header("float32"), keys, values)
    assert len(fp8_blob) < 0.4 * len(native)


def test_any_flipped_byte_is_detected() -> None:
    blob = bytearray(encode_kv_blob(_header("float32"), *_tensors()))
    for position in (12, len(blob) // 2, len(blob) - 1):
        corrupted = bytearray(blob)
        corrupted[position] ^= 0x01
        with pytest.raises(CorruptKvBlob):
            read_kv_header(bytes(corrupted))


def test_truncated_blob_is_detected() -> None:
    blob = encode_kv_blob(_header("float32"), *_tensors())
    with pytest.raises(CorruptKvBlob):
        decode_kv_blob(blob[: len(blob) - 10])


def test_shape_mismatch_is_refused_at_encoding() -> None:
    keys, values = _tensors()
    with pytest.raises(ValueError):
        encode_kv_blob(_header("float32", tokens=4), keys, values)
