"""Writes never wait behind reads for a thread: with every read thread busy (a flood of RetrieveAndStage calls
waiting on the coordination database), an IngestFacts still completes (the 3-replica load test's
DEADLINE_EXCEEDED). Real servicer and gRPC server in this process, so the test can hold the read threads itself."""

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
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
