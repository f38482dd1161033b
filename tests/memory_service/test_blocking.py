"""Writes never wait behind reads for a thread: with every read thread busy (a flood of RetrieveAndStage calls
waiting on the coordination database), an IngestFacts still completes (the 3-replica load test's
DEADLINE_EXCEEDED). Real servicer and gRPC server in this process, so the test can hold the read threads itself."""

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import decode_kv_blob
from inferscale_kv.runtime import free_port
from memory_service.config import ServiceConfig


async def test_an_ingest_completes_while_every_read_thread_is_busy(tmp_path) -> None:
    import memory_service.builder as builder_module
    import memory_service.server as server_module

    config = ServiceConfig(data_dir=tmp_path / "data", host="127.0.0.1", port=free_port(), metrics_port=0)
    stop = asyncio.Event()
    serving = asyncio.create_task(server_module.serve(config, stop))
    gate = threading.Event()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.port}") as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(3000):
                assert not serving.done(), "the service stopped while starting"
                check = await health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=10)
                if check.status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            held = [loop.run_in_executor(None, gate.wait) for _ in range(builder_module.READ_THREADS)]
            response = await stub.IngestFacts(pb.IngestFactsRequest(user_id="u", facts=[
                pb.FactInput(fact_id="f1", text="Ines restores vintage typewriters.")]), timeout=20)
            assert [fact.fact_id for fact in response.facts] == ["f1"]
            gate.set()
            await asyncio.gather(*held)
            found = await stub.SearchFacts(pb.SearchFactsRequest(user_id="u", query="typewriters", top_k=1), timeout=30)
            assert [scored.fact.fact_id for scored in found.facts] == ["f1"]
    finally:
        gate.set()
        stop.set()
        await serving


async def test_fetch_kv_builds_and_encodes_its_messages_on_a_kv_read_thread(tmp_path, monkeypatch) -> None:
    """A FetchKv message carries a blob of megabytes: building and encoding it on the event loop would stall every
    other call the service is answering. Each is made on one of FetchKv's own threads and sent as it was encoded."""
    import memory_service.server as server_module
    import memory_service.servicer as servicer_module
    from tests.memory_service.test_kv_pipeline import _complete, _ingest, _lease, _profile, _upload

    made_on: list[str] = []
    encode = servicer_module.fetch_kv_response_bytes

    def recording(*args):
        made_on.append(threading.current_thread().name)
        return encode(*args)

    monkeypatch.setattr(servicer_module, "fetch_kv_response_bytes", recording)
    config = ServiceConfig(data_dir=tmp_path / "data", host="127.0.0.1", port=free_port(), metrics_port=0,
                           kv_audit_share=0.0)
    stop = asyncio.Event()
    serving = asyncio.create_task(server_module.serve(config, stop))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while (await health.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=30)).status != \
                    health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.1)

            def store_kv() -> tuple[pb.KvProfile, list[pb.FactRef]]:  # the test plays the worker, blocking calls
                with grpc.insecure_channel(f"127.0.0.1:{config.port}") as blocking_channel:
                    stub = memory_pb2_grpc.MemoryServiceStub(blocking_channel)
                    profile = _profile("model-fetch-threads")
                    stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                                   announcer_id="w"))
                    _ingest(stub, "fetcher", count=3)
                    lease = _lease(stub, profile)
                    assert _complete(stub, profile, lease, [_upload(profile, item) for item in lease.items]).accepted
                    staged = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
                        user_id="fetcher", query="fact", top_k=3, profile=profile, node_id="n1"))
                    return profile, [pb.FactRef(fact_id=f.fact_id, version=f.version, content_id=f.content_id)
                                     for f in staged.facts]

            profile, refs = await asyncio.to_thread(store_kv)
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            replies = [reply async for reply in stub.FetchKv(pb.FetchKvRequest(
                profile_id=profile.profile_id, user_id="fetcher", facts=refs), timeout=30)]
            assert [reply.fact_id for reply in replies] == [ref.fact_id for ref in refs]
            assert all(decode_kv_blob(reply.blob).header.fact_id == reply.fact_id for reply in replies)
            assert len(made_on) == 3 and all(name.startswith("kv-read") for name in made_on), made_on
    finally:
        stop.set()
        await serving
