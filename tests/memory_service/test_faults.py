"""Faults with real processes: the memory service killed (-9) during a stream of acknowledged ingests, and a
precompute worker killed (-9) holding a lease."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.profile import kv_profile_id
from tests.conftest import run_worker
from tests.inference_node.conftest import tiny_profile
from tests.stacks import Users

USER = "fault-user"  # on a service of its own
USERS = Users(__name__)


def _profile() -> pb.KvProfile:
    profile = pb.KvProfile(model="fault-model", model_hash="mh", kv_dtype="float32", tokenizer_hash="th",
                           header_hash="hh", recipe="chunked-rope-cwe", recipe_version=1, context_window=0)
    profile.profile_id = kv_profile_id(profile)
    return profile


def _all_fact_ids(stub, user_id: str) -> list[str]:
    ids, token = [], ""
    while True:
        page = stub.ListFacts(pb.ListFactsRequest(user_id=user_id, page_size=500, page_token=token))
        ids += [fact.fact_id for fact in page.facts]
        if not (token := page.next_page_token):
            return ids


def _ingest_until_killed(stub, acknowledged: list[str], stop: threading.Event) -> None:
    serial = 0
    while not stop.is_set():
        batch = [pb.FactInput(fact_id=f"f{serial + n:05d}", text=f"Fact number {serial + n} about gardening.")
                 for n in range(3)]
        try:
            stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=batch), timeout=10)
        except grpc.RpcError:
            return  # the service is gone: this batch was never acknowledged
        acknowledged += [fact.fact_id for fact in batch]
        serial += len(batch)


def test_kill_9_during_acknowledged_ingests_loses_none_duplicates_none_and_the_kv_queue_resumes(tmp_path):
    service = MemoryServiceProcess(tmp_path / "data", tmp_path / "service.log").start()
    profile = _profile()
    acknowledged: list[str] = []
    with service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER, announcer_id="w"))
        stop = threading.Event()
        ingesting = threading.Thread(target=_ingest_until_killed, args=(stub, acknowledged, stop))
        ingesting.start()
        deadline = time.monotonic() + 60
        while len(acknowledged) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        service.stop(signal.SIGKILL)
        stop.set()
        ingesting.join(timeout=30)
    assert len(acknowledged) >= 60

    restarted = MemoryServiceProcess(tmp_path / "data", tmp_path / "restarted.log").start()
    try:
        with restarted.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            stored = _all_fact_ids(stub, USER)
            assert len(stored) == len(set(stored)), "a fact is stored twice"
            assert set(acknowledged) <= set(stored), f"lost: {sorted(set(acknowledged) - set(stored))[:5]}"
            # Retrying the batch that was cut off stores it once, whatever the kill left of it.
            retry = [pb.FactInput(fact_id=f"f{len(acknowledged) + n:05d}",
                                  text=f"Fact number {len(acknowledged) + n} about gardening.") for n in range(3)]
            stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=retry))
            stored = _all_fact_ids(stub, USER)
            assert len(stored) == len(set(stored)) == len(set(acknowledged) | {fact.fact_id for fact in retry})
            (kv,) = [p for p in stub.GetStats(pb.GetStatsRequest(user_id=USER)).profiles
                     if p.profile_id == profile.profile_id]
            assert kv.queued + kv.leased + kv.done == len(stored)  # every fact still has its KV work queued
            leased: list[str] = []
            while True:  # leases are capped (--kv-lease-max-facts): take them until the queue is empty
                lease = stub.LeaseKvWork(pb.LeaseKvWorkRequest(
                    worker_id="after-restart", profile_id=profile.profile_id, max_facts=1000, lease_seconds=60))
                if not lease.items:
                    break
                leased += [item.fact_id for item in lease.items]
            assert sorted(leased) == sorted(stored)
    finally:
        restarted.stop()


def test_a_worker_killed_holding_a_lease_has_its_facts_redone_by_another(memory_service, stub, tiny_llama_dir):
    user = USERS("fault-worker-user")
    run_worker(memory_service, tiny_llama_dir)  # the shared service's work left by others: the lease below is ours
    profile_id = tiny_profile(tiny_llama_dir).profile_id
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
        pb.FactInput(text=f"Fact {n}: the user collects {n} stamps.") for n in range(120)]))
    doomed = subprocess.Popen(
        [sys.executable, "-m", "precompute_worker", "--memory-service", memory_service.address, "--model",
         str(tiny_llama_dir), "--lease-seconds", "3", "--max-facts", "120", "--poll-interval-s", "0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            profiles = stub.GetStats(pb.GetStatsRequest(user_id=user)).profiles
            if any(p.leased for p in profiles if p.profile_id == profile_id):
                break
            time.sleep(0.02)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        (leased,) = [p for p in stub.GetStats(pb.GetStatsRequest(user_id=user)).profiles if p.profile_id == profile_id]
        assert leased.leased > 0, "the worker finished before it could be killed holding a lease"
    finally:
        if doomed.poll() is None:
            doomed.kill()
    time.sleep(3.5)  # the dead worker's lease expires
    run_worker(memory_service, tiny_llama_dir)
    (after,) = [p for p in stub.GetStats(pb.GetStatsRequest(user_id=user)).profiles if p.profile_id == profile_id]
    assert (after.done, after.leased, after.failed, after.queued) == (120, 0, 0, 0)
