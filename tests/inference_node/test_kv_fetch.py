"""The node's byte path (inference_node.kv_fetch.MemoryServiceKv): a fetch's chunks over several concurrent
FetchKv calls, each blob checked (checksum, key, token ids) and decoded into this rank's heads without a Python pass
over its bytes; against the real memory service, and against a stand-in that serves what a broken one would."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import grpc
import pytest
import torch

from inference_node.kv_fetch import MemoryServiceKv, fetch_reply_blob
from inference_node.plan import ChunkLoad
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import CorruptKvBlob, decode_kv_blob, decode_kv_heads
from inferscale_kv.blob_names import blob_name
from inferscale_kv.kv_key import KvKey
from memory_service.servicer import fetch_kv_response_bytes
from tests.inference_node.conftest import kv_blob, random_kv, stored_chunks, tiny_profile
from tests.stacks import Users

user = Users(__name__)


# ---------------------------------------------------------------------------------------------- decoding in place

@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float32", "float16", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [None, slice(0, 1), slice(1, 2)])
def test_decoding_a_rank_s_heads_in_place_equals_decoding_the_blob_then_slicing(storage_dtype, heads) -> None:
    blob = kv_blob(KvKey("p", "u", "f", 1, "0" * 32), tuple(range(5)), 3, storage_dtype)
    for dtype in (torch.bfloat16, torch.float32):
        reference = decode_kv_blob(blob, dtype)
        decoded = decode_kv_heads(memoryview(blob), dtype, heads)  # a read-only buffer, as gRPC hands it over
        wanted = heads or slice(None)
        assert torch.equal(decoded.keys, reference.keys[:, :, wanted])
        assert torch.equal(decoded.values, reference.values[:, :, wanted])
        assert decoded.keys.is_contiguous() and decoded.values.is_contiguous() and decoded.keys.dtype == dtype


def test_a_reply_s_blob_is_read_out_of_its_serialized_bytes_as_protobuf_reads_it() -> None:
    key = KvKey("p", "u", "f", 300, "1" * 32)
    for blob in (b"", b"x", bytes(range(256)) * 1000):
        framed = fetch_kv_response_bytes(key, blob)
        message = pb.FetchKvResponse.FromString(framed)
        assert (message.blob, message.fact_id, message.version, message.content_id) == (blob, "f", 300, "1" * 32)
        assert bytes(fetch_reply_blob(framed)) == blob
        assert bytes(fetch_reply_blob(message.SerializeToString())) == blob
    with pytest.raises(CorruptKvBlob):
        fetch_reply_blob(fetch_kv_response_bytes(key, b"abc")[:-1])


# ---------------------------------------------------------------------------------------------- the real service

@pytest.fixture(scope="module")
def profile(tiny_llama_dir) -> pb.KvProfile:
    return tiny_profile(tiny_llama_dir)


@pytest.mark.parametrize("streams", [1, 4])
def test_a_fetch_over_parallel_streams_returns_every_chunk_in_the_order_asked(node_memory_service, node_stub, profile,
                                                                              streams) -> None:
    user_id = user(f"ordered-{streams}")
    chunks = stored_chunks(node_stub, profile, user_id)
    random.Random(streams).shuffle(chunks)
    source = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2), streams=streams)
    fetched = source.fetch(user_id, chunks, torch.float32)
    assert [entry.token_ids for entry in fetched] == [chunk.token_ids for chunk in chunks]
    for chunk, entry in zip(chunks, fetched, strict=True):
        keys, values = random_kv(len(chunk.token_ids), int(chunk.key.fact_id[1:]))
        assert torch.equal(entry.keys, keys) and torch.equal(entry.values, values)
    second_head = MemoryServiceKv(node_memory_service.address, 30, slice(1, 2), streams=streams)
    for whole, half in zip(fetched, second_head.fetch(user_id, chunks, torch.float32), strict=True):
        assert half.keys.shape[2] == 1 and torch.equal(half.keys, whole.keys[:, :, 1:2])
        assert torch.equal(half.values, whole.values[:, :, 1:2]) and half.keys.is_contiguous()


def test_a_deleted_fact_is_never_fetched_and_fails_the_whole_fetch(node_memory_service, node_stub, profile) -> None:
    user_id = user("deleted")
    chunks = stored_chunks(node_stub, profile, user_id)
    source = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2), streams=4)
    assert len(source.fetch(user_id, chunks, torch.float32)) == len(chunks)
    node_stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user_id, fact_ids=[chunks[-1].key.fact_id]))
    with pytest.raises(LookupError, match=chunks[-1].key.fact_id):
        source.fetch(user_id, chunks, torch.float32)
    assert len(source.fetch(user_id, chunks[:-1], torch.float32)) == len(chunks) - 1


def test_a_blob_asked_for_under_another_content_id_is_not_served(node_memory_service, node_stub, profile) -> None:
    user_id = user("renamed")
    chunks = stored_chunks(node_stub, profile, user_id)
    renamed = ChunkLoad(dataclasses.replace(chunks[0].key, content_id="f" * 32), chunks[0].token_ids, 0)
    source = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2), streams=4)
    with pytest.raises(LookupError):
        source.fetch(user_id, [*chunks[1:], renamed], torch.float32)


def test_a_blob_corrupted_in_the_durable_tier_is_refused(node_memory_service, node_stub, profile) -> None:
    """The service checks what it reads (and queues the fact again); the node gets no KV for it, never the bytes."""
    user_id = user("corrupt-on-disk")
    chunks = stored_chunks(node_stub, profile, user_id)
    path = Path(node_memory_service.data_dir) / "kv" / "blobs" / blob_name(chunks[4].key)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF
    path.write_bytes(bytes(data))
    source = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2), streams=4)
    with pytest.raises(LookupError, match=chunks[4].key.fact_id):
        source.fetch(user_id, chunks, torch.float32)


# ---------------------------------------------------------------------------------------------- a broken service

def test_the_header_and_the_facts_are_split_in_order_over_the_streams(stand_in) -> None:
    address, servicer, chunks = stand_in
    fetched = MemoryServiceKv(address, 10, slice(0, 2), streams=3).fetch("stand-in-user", chunks, torch.bfloat16)
    assert [entry.token_ids for entry in fetched] == [chunk.token_ids for chunk in chunks]
    asked = sorted([ref.fact_id for ref in request.facts] for request in servicer.requests)
    assert sum(request.include_header for request in servicer.requests) == 1 and len(asked) == 3
    assert [fact_id for facts in asked for fact_id in facts] == [f"f{index}" for index in range(7)]
    with_header = next(request for request in servicer.requests if request.include_header)
    assert with_header.header_content_id == "a" * 32 and [ref.fact_id for ref in with_header.facts] == ["f0"]


@pytest.mark.parametrize("tampering", ["flipped byte", "other key", "other tokens", "missing"])
def test_a_blob_that_fails_its_checks_fails_the_fetch(stand_in, tampering) -> None:
    address, servicer, chunks = stand_in
    victim = chunks[5].key
    others = {chunk.key: servicer.blobs[chunk.key] for chunk in chunks}

    def tamper(key: KvKey, blob: bytes) -> bytes:
        if key != victim:
            return blob
        if tampering == "flipped byte":
            return blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:]
        if tampering == "other key":
            return others[chunks[4].key]
        if tampering == "other tokens":
            return kv_blob(victim, (9, 9, 9, 9, 9, 9), 1)
        return b""

    servicer.tamper = tamper
    expected = LookupError if tampering == "missing" else CorruptKvBlob
    with pytest.raises(expected):
        MemoryServiceKv(address, 10, slice(0, 2), streams=4).fetch("stand-in-user", chunks, torch.bfloat16)


def test_a_stream_that_breaks_fails_the_fetch_with_its_error(stand_in) -> None:
    address, servicer, chunks = stand_in
    servicer.refuse = grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as raised:
        MemoryServiceKv(address, 10, slice(0, 2), streams=4).fetch("stand-in-user", chunks, torch.bfloat16)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
