"""The memory step under load, on the CPU: Llama-3-8B-sized fact KV from the synthetic worker (~4.4 MiB per fact),
a host cache smaller than the KV, tens of concurrent RetrieveAndStage callers at k=50 (benchmarks.memory_step is
the same setup, timed). No timing is asserted: the work done per call is, and every call keeping its memory within a
deadline far above the target.

Regression: every RetrieveAndStage promoted its facts' KV from the durable tier into the memory tiers, also when the
node held it already, in a FIFO pool shared with the request path and behind one lock, so calls queued for seconds
and lost their memory at the node's deadline (issue: "Under load the memory step sets the pace")."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.dummy_model import build_dummy_model
from benchmarks.memory_step import closed_loop, fetch_facts, populate, retrieval_requests, service_counters
from benchmarks.synthetic import synthetic_queries
from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW

USERS, FACTS_PER_USER, K, CALLERS, CALLS_PER_CALLER = 4, 50, 50, 32, 4
HOST_CACHE_MB = 256  # about one user's KV; the four users hold ~880 MiB
DEADLINE_S = 10.0  # per call; the target is 25 ms at 8 callers


@pytest.fixture(scope="module")
def loaded_service(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
                   ) -> Iterator[tuple[MemoryServiceProcess, pb.KvProfile]]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("memory_step")
    model_dir = build_dummy_model(root / "llama3-8b", "llama3-8b", smollm2_dir, "bfloat16")
    profile = build_model_profile(model_dir, AutoTokenizer.from_pretrained(model_dir), "bfloat16",
                                  DEFAULT_CONTEXT_WINDOW)
    service = MemoryServiceProcess(root / "data", root / "service.log", "--kv-host-budget-mb",
                                   str(HOST_CACHE_MB)).start()
    try:
        populate(service, model_dir, [f"step-{index}" for index in range(USERS)], FACTS_PER_USER, 2, "bfloat16", {})
        yield service, pb.KvProfile(**profile.as_dict())
    finally:
        service.stop()


def test_retrieve_and_stage_reads_no_kv_and_every_call_keeps_its_memory(loaded_service) -> None:
    service, profile = loaded_service
    requests = retrieval_requests([f"step-{index}" for index in range(USERS)], synthetic_queries(16, seed=5),
                                  profile, K, [], "")

    async def run():
        async with grpc.aio.insecure_channel(service.address) as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            return await closed_loop(stub, requests, CALLERS, 600.0, K, fetch=False, seed=1,
                                     calls_per_caller=CALLS_PER_CALLER, timeout_s=DEADLINE_S)

    before = service_counters(service.metrics_port)
    phase = asyncio.run(run())
    after = service_counters(service.metrics_port)
    assert phase.calls == CALLERS * CALLS_PER_CALLER
    assert phase.lost == [], phase.lost[:5]  # every call: 50 facts, all with KV ready, the header's too
    # The request path reads no KV: nothing moves toward a node before it fetches (before: ~16-22 durable-tier
    # reads per call, promotions into the memory tiers).
    assert {name: after[name] - before[name] for name in after} == {
        "durable_lookups": 0, "durable_bytes_read": 0, "host_bytes_read": 0, "bytes_served": 0}


def test_concurrent_fetches_of_one_users_kv_read_each_blob_from_storage_once(loaded_service) -> None:
    service, profile = loaded_service
    (request,) = retrieval_requests(["step-0"], ["what did she plan"], profile, K, [], "")

    async def run() -> None:
        async with grpc.aio.insecure_channel(service.address,
                                             options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            response = await stub.RetrieveAndStage(request, timeout=DEADLINE_S)
            # Eight nodes whose caches lack the user's KV fetch it at once.
            await asyncio.gather(*(fetch_facts(stub, request, response) for _ in range(8)))

    before = service_counters(service.metrics_port)
    asyncio.run(run())
    after = service_counters(service.metrics_port)
    # 51 blobs (the header and 50 facts) of ~4.4 MiB, fetched 8 times: read from storage at most once each.
    assert after["bytes_served"] - before["bytes_served"] >= 8 * K * (4 << 20)
    assert after["durable_lookups"] - before["durable_lookups"] == K + 1  # the cache was empty: one miss each
    assert after["durable_bytes_read"] - before["durable_bytes_read"] <= (K + 1) * (5 << 20)
