"""Fact KV read straight from the memory service's durable tier (inference_node.durable_blobs, --kv-durable-tier):
against the real service's KV directory, and a real S3 store (SeaweedFS) written by the service's own object-store
tier. The same bytes as FetchKv, FetchKv only for what the tier lacks, every blob checked before it is handed on,
nothing read after a delete is acknowledged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from inference_node.durable_blobs import BucketBlobs, DirectoryBlobs, durable_blobs
from inference_node.kv_fetch import MemoryServiceKv
from inference_node.plan import ChunkLoad
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import CorruptKvBlob
from inferscale_kv.blob_names import blob_name
from inferscale_kv.kv_key import KvKey
from tests.inference_node.conftest import kv_blob, stored_chunks, tiny_profile
from tests.stacks import Users

user = Users(__name__)


@pytest.fixture(scope="module")
def profile(tiny_llama_dir) -> pb.KvProfile:
    return tiny_profile(tiny_llama_dir)


def _blobs_dir(service) -> Path:
    return Path(service.data_dir) / "kv" / "blobs"


def _fetch_calls(servicer_metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in servicer_metrics.splitlines()
               if line.startswith("inferscale_kv_fetched_blobs_total"))


def _service_blobs_served(service) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10) as response:
        return _fetch_calls(response.read().decode())


def _same(got, wanted) -> None:
    for mine, theirs in zip(got, wanted, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_the_durable_tier_gives_fetchkvs_bytes_and_fetchkv_brings_only_what_it_lacks(
        node_memory_service, node_stub, profile, tmp_path) -> None:
    user_id = user("durable")
    chunks = stored_chunks(node_stub, profile, user_id)
    over_fetchkv = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2))
    wanted = over_fetchkv.fetch(user_id, chunks, torch.float32)
    served = _service_blobs_served(node_memory_service)
    direct = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2),
                             durable=DirectoryBlobs(_blobs_dir(node_memory_service)))
    _same(direct.fetch(user_id, chunks, torch.float32), wanted)
    assert _service_blobs_served(node_memory_service) == served  # nothing over FetchKv
    partial = tmp_path / "blobs"  # a tier that holds every other chunk
    for chunk in chunks[::2]:
        (partial / blob_name(chunk.key)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_blobs_dir(node_memory_service) / blob_name(chunk.key), partial / blob_name(chunk.key))
    mixed = MemoryServiceKv(node_memory_service.address, 30, slice(1, 2), durable=DirectoryBlobs(partial))
    _same(mixed.fetch(user_id, chunks, torch.float32),
          MemoryServiceKv(node_memory_service.address, 30, slice(1, 2)).fetch(user_id, chunks, torch.float32))
    assert _service_blobs_served(node_memory_service) == served + len(chunks[1::2]) + len(chunks)


@pytest.mark.parametrize("tampering", ["flipped byte", "cut short", "another key's blob", "other tokens"])
def test_a_durable_blob_that_fails_its_checks_fails_the_fetch(tmp_path, tampering) -> None:
    """Checked before anything is handed on: a torn or corrupted file, or a file holding another key's KV (or other
    tokens) under this key's name, fails the fetch (the request prefills): never loaded, never asked elsewhere."""
    key, tokens = KvKey("p", "u1", "f", 1, "a" * 32), (5, 6, 7)
    blob = bytearray(kv_blob(key, tokens, 1))
    if tampering == "flipped byte":
        blob[-5] ^= 1
    elif tampering == "cut short":
        blob = blob[:-64]
    elif tampering == "another key's blob":
        blob = bytearray(kv_blob(KvKey("p", "u2", "f", 1, "a" * 32), tokens, 1))
    path = tmp_path / blob_name(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(bytes(blob))
    chunk = ChunkLoad(key, (5, 6, 8) if tampering == "other tokens" else tokens, 0)
    source = MemoryServiceKv("127.0.0.1:1", 5, slice(0, 2), durable=DirectoryBlobs(tmp_path))
    with pytest.raises(CorruptKvBlob):
        source.fetch("u1", [chunk], torch.float32)


def test_a_deleted_fact_is_not_read_from_the_durable_tier_once_the_delete_returns(
        node_memory_service, node_stub, profile) -> None:
    user_id = user("durable-delete")
    chunks = stored_chunks(node_stub, profile, user_id)
    source = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2),
                             durable=DirectoryBlobs(_blobs_dir(node_memory_service)))
    source.fetch(user_id, chunks, torch.float32)
    node_stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user_id, fact_ids=[chunks[3].key.fact_id]))
    assert source.durable is not None and source.durable.read(chunks[3].key) is None
    with pytest.raises(LookupError, match=chunks[3].key.fact_id):  # nor served by the service: the fetch fails
        source.fetch(user_id, chunks, torch.float32)


def test_a_name_that_would_leave_the_directory_is_never_read(tmp_path) -> None:
    (tmp_path / "outside.kv").write_bytes(b"secret")
    tier = DirectoryBlobs(tmp_path / "blobs")
    for key in (KvKey("..", "..", "outside", 1, "a" * 32), KvKey("p", ".", "f", 1, "a" * 32)):
        assert tier.read(key) is None


def test_the_durable_tier_flag_names_a_directory_or_a_bucket() -> None:
    assert durable_blobs("") is None
    assert isinstance(durable_blobs("/srv/kv/blobs"), DirectoryBlobs)
    bucket = durable_blobs("s3://inferscale/service/kv")
    assert isinstance(bucket, BucketBlobs) and (bucket.bucket, bucket.prefix) == ("inferscale", "service/kv")
    for wrong in ("s3://", "s3://UPPER/kv", "gs://bucket/kv"):
        with pytest.raises(ValueError, match="--kv-durable-tier"):
            durable_blobs(wrong)


def test_a_bucket_written_by_the_services_object_store_tier_is_read_by_the_node(tmp_path, monkeypatch) -> None:
    """The node and the service agree on every object's name (inferscale_kv.blob_names); a removed object (what a
    delete does before it is acknowledged) is not there to read."""
    from harness.servers import seaweedfs_s3
    from memory_service.object_store import ObjectStoreTier

    key, tokens = KvKey("p", "u1", "f7", 3, "b" * 32), (1, 2, 3, 4)
    blob = kv_blob(key, tokens, 7)
    with seaweedfs_s3(tmp_path / "s3") as s3:
        s3.create_bucket("inferscale")
        written = ObjectStoreTier(s3.client(), "inferscale", "service/kv")
        assert written.put(key, blob)
        for variable, value in {**s3.environment(), "AWS_ENDPOINT_URL": s3.url,
                                "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(variable, value)
        tier = durable_blobs("s3://inferscale/service/kv")
        assert tier is not None
        read = tier.read(key)
        assert read is not None and bytes(read) == blob
        source = MemoryServiceKv("127.0.0.1:1", 5, slice(0, 2), durable=tier)
        (entry,) = source.fetch("u1", [ChunkLoad(key, tokens, 0)], torch.float32)
        assert entry.token_ids == tokens
        written.remove(key)
        assert tier.read(key) is None
        assert tier.read(KvKey("p", "u1", "never", 1, "c" * 32)) is None
