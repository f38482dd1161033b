"""Fact KV read straight from the memory service's durable tier (inference_node.durable_blobs, --kv-durable-tier):
against the real service's KV directory, and a real S3 store (SeaweedFS) written by the service's own object-store
tier. The same bytes as FetchKv, FetchKv only for what the tier lacks, every blob checked before it is handed on,
nothing read after a delete is acknowledged."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from harness.router import metric_total, prometheus_samples
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


def _service_blobs_served(service) -> float:
    """Blobs the service was asked for over FetchKv (served or missing)."""
    return metric_total(prometheus_samples(f"http://127.0.0.1:{service.metrics_port}/metrics"),
                        "inferscale_kv_fetched_blobs_total")


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


@pytest.mark.parametrize("tampering", ["flipped byte", "cut short", "another key's blob", "a link", "a pipe"])
def test_a_durable_blob_that_fails_its_checks_is_never_handed_on_the_service_is_asked(
        node_memory_service, node_stub, profile, tmp_path, tampering) -> None:
    """Checked before anything is handed on: a torn or corrupted file, a file holding another key's KV under this
    key's name, a link or a pipe in the durable tier is not loaded; the chunk comes over FetchKv instead (whose
    service checks its own copy and queues a corrupt one again), so the fetch gets the right bytes."""
    user_id = user(f"tampered-{tampering.replace(' ', '-').replace(chr(39), '')}")
    chunks = stored_chunks(node_stub, profile, user_id)
    tier = tmp_path / "blobs"  # a copy of the service's, the victim's blob then tampered with
    shutil.copytree(_blobs_dir(node_memory_service), tier)
    victim = tier / blob_name(chunks[2].key)
    blob = bytearray(victim.read_bytes())
    victim.unlink()
    if tampering == "flipped byte":
        blob[-5] ^= 1
    elif tampering == "cut short":
        blob = blob[:-64]
    elif tampering == "another key's blob":
        blob = bytearray((tier / blob_name(chunks[3].key)).read_bytes())
    if tampering == "a link":
        victim.symlink_to(tier / blob_name(chunks[2].key).replace(".kv", ".elsewhere"))
        victim.with_suffix(".elsewhere").write_bytes(bytes(blob))
    elif tampering == "a pipe":
        os.mkfifo(victim)
    else:
        victim.write_bytes(bytes(blob))
    served = _service_blobs_served(node_memory_service)
    source = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2), durable=DirectoryBlobs(tier))
    _same(source.fetch(user_id, chunks, torch.float32),
          MemoryServiceKv(node_memory_service.address, 30, slice(0, 2)).fetch(user_id, chunks, torch.float32))
    assert _service_blobs_served(node_memory_service) == served + 1 + len(chunks)  # the victim, then the reference


def test_a_blob_of_other_tokens_than_the_plans_fails_the_fetch(node_memory_service, node_stub, profile) -> None:
    user_id = user("durable-other-tokens")
    chunks = stored_chunks(node_stub, profile, user_id)
    chunks[2] = ChunkLoad(chunks[2].key, (*chunks[2].token_ids[:-1], chunks[2].token_ids[-1] + 1), 0)
    source = MemoryServiceKv(node_memory_service.address, 30, slice(0, 2),
                             durable=DirectoryBlobs(_blobs_dir(node_memory_service)))
    with pytest.raises(CorruptKvBlob):  # the durable tier's blob and then the service's disagree with the plan
        source.fetch(user_id, chunks, torch.float32)


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
    """A key of `..` or `.` components (never a stored blob's: ids start with a letter or digit) would name a file
    outside the tier's root, or another key's file: not read, even where a well-formed blob lies there."""
    root = tmp_path / "a" / "b" / "blobs"
    outside = KvKey("..", "..", "outside", 1, "a" * 32)
    dotted, plain = KvKey("p", ".", "f", 1, "a" * 32), KvKey("p", "f", "f", 1, "a" * 32)
    for key, lands in ((outside, tmp_path / "a" / f"outside.v1.{'a' * 32}.kv"), (dotted, root / blob_name(plain)
                                                                                .replace("/f/f.", "/f.", 1))):
        lands.parent.mkdir(parents=True, exist_ok=True)
        lands.write_bytes(kv_blob(key, (1, 2), 3))
        assert (root / blob_name(key)).resolve() == lands.resolve()  # where a plain join would read
        assert DirectoryBlobs(root).read(key) is None


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


def test_reads_that_take_the_fetchs_time_leave_none_to_fetchkv_the_fetch_ends_in_it() -> None:
    """Review of issue 41: FetchKv was given the fetch's whole deadline again after slow durable reads, so the fetch
    process outlived the deadline its worker kills it at (failing every other user's fetch in it)."""
    import time

    class SlowTier:
        def read(self, key: KvKey) -> memoryview | None:
            time.sleep(0.6)
            return None

    source = MemoryServiceKv("127.0.0.1:1", 0.5, slice(0, 2), durable=SlowTier())
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        source.fetch("u1", [ChunkLoad(KvKey("p", "u1", "f", 1, "a" * 32), (1, 2), 0)], torch.float32)
    assert time.monotonic() - started < 1.5
