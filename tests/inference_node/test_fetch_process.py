"""The node's fetch process (inference_node.fetch_process): fetches run out of vLLM's engine process and hand their
decoded heads over through a shared arena; what comes out equals the in-process byte path's, a fetch larger than the
arena's part goes in parts, errors keep their kind, a fetch process that dies fails what it had in flight and the next
fetch starts another, and a region is reused only once the child answered for it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from inference_node import fetch_process
from inference_node.fetch_process import FetchProcessKv, KvFetchFailed, _Arena
from inference_node.kv_fetch import MemoryServiceKv
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.blob import CorruptKvBlob
from inferscale_kv.shape import KvShape
from tests.inference_node.conftest import stored_chunks, tiny_profile
from tests.stacks import Users

user = Users(__name__)
RANK_SHAPE = KvShape(4, 1, 64)  # the stand-in's KV (4 layers x 2 heads x 64), this rank holding head 1


def _source(address: str, **options) -> FetchProcessKv:
    return FetchProcessKv(address, options.pop("timeout_s", 10), slice(1, 2), RANK_SHAPE, **options)


def test_the_fetch_process_imports_neither_vllm_nor_the_connector() -> None:
    script = ("import sys, inference_node.fetch_process, inference_node.kv_fetch; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m == 'inference_node.connector'))")
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_a_fetch_through_the_process_equals_the_in_process_byte_path(stand_in) -> None:
    address, _, chunks = stand_in
    source = _source(address)
    try:
        fetched = source.fetch("stand-in-user", chunks, torch.bfloat16)
        direct = MemoryServiceKv(address, 10, slice(1, 2), streams=2).fetch("stand-in-user", chunks, torch.bfloat16)
        assert [entry.token_ids for entry in fetched] == [chunk.token_ids for chunk in chunks]
        for ours, theirs in zip(fetched, direct, strict=True):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
            assert ours.keys.shape == RANK_SHAPE.of(len(ours.token_ids)) and ours.keys.dtype == torch.bfloat16
            # each its own compact storage: the host tier keeps it as it is
            assert ours.keys.untyped_storage().nbytes() == ours.keys.numel() * 2
        assert source._arena._free == [(0, source._arena.size)]
    finally:
        source.close()


def test_concurrent_fetches_each_get_their_own_chunks_bytes(stand_in) -> None:
    """Fetches racing through one arena (small: regions are reused between them) each get exactly their chunks'
    KV, never bytes another fetch's region held."""
    address, _, chunks = stand_in
    direct = MemoryServiceKv(address, 10, slice(1, 2), streams=1).fetch("stand-in-user", chunks, torch.bfloat16)
    expected = {chunk.key: entry for chunk, entry in zip(chunks, direct, strict=True)}
    source = _source(address, arena_bytes=256 << 10)
    errors: list[BaseException] = []

    def fetch(seed: int) -> None:
        order = list(chunks)
        random.Random(seed).shuffle(order)
        try:
            for _ in range(5):
                picked = order[: 1 + seed % len(order)]
                for chunk, entry in zip(picked, source.fetch("stand-in-user", picked, torch.bfloat16), strict=True):
                    assert torch.equal(entry.keys, expected[chunk.key].keys)
                    assert torch.equal(entry.values, expected[chunk.key].values)
        except BaseException as error:
            errors.append(error)

    try:
        threads = [threading.Thread(target=fetch, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == [] and source._arena._free == [(0, source._arena.size)]
    finally:
        source.close()


def test_a_fetch_larger_than_a_part_of_the_arena_goes_in_parts(stand_in) -> None:
    address, servicer, chunks = stand_in
    source = _source(address, arena_bytes=64 << 10)  # parts of 16 KiB: one to three chunks each
    try:
        fetched = source.fetch("stand-in-user", chunks, torch.float32)
        assert len(servicer.requests) >= 4
        whole = MemoryServiceKv(address, 10, slice(1, 2), streams=1).fetch("stand-in-user", chunks, torch.float32)
        assert all(torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
                   for ours, theirs in zip(fetched, whole, strict=True))
        assert source._arena._free == [(0, source._arena.size)]
    finally:
        source.close()


@pytest.mark.parametrize(("failure", "expected"), [("flipped byte", CorruptKvBlob), ("missing", LookupError),
                                                   ("refused", KvFetchFailed)])
def test_a_failed_fetch_is_raised_with_its_kind_and_frees_its_regions(stand_in, failure, expected) -> None:
    address, servicer, chunks = stand_in
    victim = chunks[3].key
    if failure == "refused":
        servicer.refuse = grpc.StatusCode.UNAVAILABLE
    else:
        servicer.tamper = lambda key, blob: blob if key != victim else (
            b"" if failure == "missing" else blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:])
    source = _source(address)
    try:
        with pytest.raises(expected) as raised:
            source.fetch("stand-in-user", chunks, torch.bfloat16)
        if failure == "refused":
            assert "UNAVAILABLE" in str(raised.value)
        assert source._arena._free == [(0, source._arena.size)]
    finally:
        source.close()


def test_a_fetch_process_that_dies_fails_its_fetches_and_the_next_fetch_starts_another(stand_in,
                                                                                    monkeypatch) -> None:
    address, servicer, chunks = stand_in
    monkeypatch.setattr(fetch_process, "RESTART_BACKOFF_S", 0.0)
    source = _source(address)
    try:
        assert len(source.fetch("stand-in-user", chunks[:2], torch.bfloat16)) == 2
        first = source.process_id
        servicer.delay_s = 30
        errors: list[BaseException] = []

        def fetch() -> None:
            try:
                source.fetch("stand-in-user", chunks, torch.bfloat16)
            except BaseException as error:
                errors.append(error)

        waiting = threading.Thread(target=fetch)
        waiting.start()
        deadline = time.monotonic() + 10
        while len(servicer.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        waiting.join(timeout=10)
        assert not waiting.is_alive() and len(errors) == 1 and isinstance(errors[0], KvFetchFailed)
        assert "exited" in str(errors[0])
        servicer.delay_s = 0
        assert len(source.fetch("stand-in-user", chunks, torch.bfloat16)) == len(chunks)
        assert source.process_id not in (None, first) and source.processes_started == 2
        assert source._arena._free == [(0, source._arena.size)]
    finally:
        source.close()


def test_a_child_that_does_not_answer_is_stopped_and_its_regions_freed_only_then(stand_in, monkeypatch) -> None:
    """A waiter that gives up on a child that does not answer (stopped here) leaves its regions held while the child
    may still write into them, stops the child, and the regions are free once it is gone; the next fetch starts
    another child."""
    address, _, chunks = stand_in
    monkeypatch.setattr(fetch_process, "ANSWER_MARGIN_S", 0.5)
    monkeypatch.setattr(fetch_process, "RESTART_BACKOFF_S", 0.0)
    source = _source(address, timeout_s=1)
    try:
        child = _stopped_child(source, chunks)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            source.fetch("stand-in-user", chunks, torch.bfloat16)
        assert time.monotonic() - started < 5
        _wait_for(lambda: source._arena._free == [(0, source._arena.size)])
        source.timeout_s = 30  # the next child's first fetch waits for it to start
        assert len(source.fetch("stand-in-user", chunks, torch.bfloat16)) == len(chunks)
        assert source.process_id not in (None, child)
    finally:
        source.close()


def test_a_child_killed_with_a_request_unread_fails_it_at_once(stand_in, monkeypatch) -> None:
    """The control socket is reset, not closed, when the child dies with a request unread: the fetch fails at once
    (not after its deadline), its regions are freed and the next fetch starts another child."""
    address, _, chunks = stand_in
    monkeypatch.setattr(fetch_process, "RESTART_BACKOFF_S", 0.0)
    source = _source(address, timeout_s=20)
    try:
        child = _stopped_child(source, chunks)
        errors: list[BaseException] = []
        waiting = threading.Thread(target=lambda: _failure(errors, source, chunks))
        waiting.start()
        time.sleep(0.5)  # the request sits in the stopped child's socket
        os.kill(child, signal.SIGKILL)
        waiting.join(timeout=10)
        assert not waiting.is_alive() and len(errors) == 1 and isinstance(errors[0], KvFetchFailed), errors
        assert source._arena._free == [(0, source._arena.size)]
        assert len(source.fetch("stand-in-user", chunks, torch.bfloat16)) == len(chunks)
    finally:
        source.close()


def test_a_child_that_exits_young_is_not_replaced_before_a_pause(stand_in, monkeypatch) -> None:
    address, _, chunks = stand_in
    monkeypatch.setattr(fetch_process, "RESTART_BACKOFF_S", 1.5)
    source = _source(address)
    try:
        child = source.process_id
        assert child is not None
        os.kill(child, signal.SIGKILL)
        _wait_for(lambda: source.process_id is None or source._child is None or source._restart_at > 0)
        with pytest.raises(KvFetchFailed, match="young"):
            source.fetch("stand-in-user", chunks, torch.bfloat16)
        time.sleep(1.6)
        assert len(source.fetch("stand-in-user", chunks, torch.bfloat16)) == len(chunks)
    finally:
        source.close()


def test_a_fetch_naming_a_chunk_twice_is_refused(stand_in) -> None:
    """Each chunk is decoded into the region of its own key: a key named twice would leave one region unwritten."""
    address, _, chunks = stand_in
    source = _source(address)
    try:
        with pytest.raises(ValueError, match="twice"):
            source.fetch("stand-in-user", [*chunks, chunks[2]], torch.bfloat16)
        into = [torch.empty(2, 4, len(chunk.token_ids), 2, 64, dtype=torch.bfloat16) for chunk in (*chunks, chunks[2])]
        with pytest.raises(ValueError, match="twice"):
            MemoryServiceKv(address, 10, slice(0, 2)).fetch("stand-in-user", [*chunks, chunks[2]], torch.bfloat16,
                                                            into)
    finally:
        source.close()


def _stopped_child(source: FetchProcessKv, chunks) -> int:
    """The source's child, stopped (SIGSTOP) once it has served a fetch (within 30 s, whatever the source's deadline:
    a child still starting on a busy machine answers its first fetch late)."""
    deadline, source.timeout_s = source.timeout_s, 30
    assert len(source.fetch("stand-in-user", chunks[:1], torch.bfloat16)) == 1
    source.timeout_s = deadline
    child = source.process_id
    assert child is not None
    os.kill(child, signal.SIGSTOP)
    return child


def _failure(errors: list[BaseException], source: FetchProcessKv, chunks) -> None:
    try:
        source.fetch("stand-in-user", chunks, torch.bfloat16)
    except BaseException as error:
        errors.append(error)


def _wait_for(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_arena_allocates_all_or_waits_and_coalesces_what_is_freed() -> None:
    arena = _Arena(16 << 10)
    first = arena.allocate([5000, 3000], timeout_s=1)  # aligned to 8 KiB and 4 KiB
    assert first == [0, 8192]
    with pytest.raises(TimeoutError):
        arena.allocate([8192], timeout_s=0.1)  # 4 KiB free: nothing is taken
    assert arena._free == [(12288, 4096)]
    later: list[list[int]] = []
    waiter = threading.Thread(target=lambda: later.append(arena.allocate([8192, 4096], timeout_s=5)))
    waiter.start()
    time.sleep(0.1)
    arena.free(first, [5000, 3000])
    waiter.join(timeout=5)
    assert later == [[0, 8192]] and arena._free == [(12288, 4096)]
    arena.free(later[0], [8192, 4096])
    assert arena._free == [(0, 16 << 10)]
    assert arena.allocate([], timeout_s=0) == []
    with pytest.raises(ValueError):
        arena.allocate([32 << 10], timeout_s=0)


@pytest.mark.parametrize("durable", [False, True], ids=["fetchkv", "durable-tier"])
def test_a_deleted_fact_is_never_fetched_through_the_process(node_memory_service, node_stub, tiny_llama_dir,
                                                             durable) -> None:
    """Also where the process reads the service's durable tier itself (--kv-durable-tier): it reads the same bytes
    there, and nothing of a fact once its delete returned."""
    user_id = user(f"deleted-{durable}")
    chunks = stored_chunks(node_stub, tiny_profile(tiny_llama_dir), user_id)
    durable_tier = str(Path(node_memory_service.data_dir) / "kv" / "blobs") if durable else ""
    source = FetchProcessKv(node_memory_service.address, 30, slice(0, 2), KvShape(4, 2, 64),
                            durable_tier=durable_tier)
    if durable:  # the same bytes as FetchKv, every chunk read from the durable tier (as the answers count)
        direct = source.fetch(user_id, chunks, torch.float32)
        assert source.durable_reads == len(chunks)
        for mine, theirs in zip(direct, MemoryServiceKv(node_memory_service.address, 30, slice(0, 2)).fetch(
                user_id, chunks, torch.float32), strict=True):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    try:
        assert len(source.fetch(user_id, chunks, torch.float32)) == len(chunks)
        node_stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user_id, fact_ids=[chunks[-1].key.fact_id]))
        with pytest.raises(LookupError, match=chunks[-1].key.fact_id):
            source.fetch(user_id, chunks, torch.float32)
    finally:
        source.close()
