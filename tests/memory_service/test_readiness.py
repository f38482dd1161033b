"""Before storage and embedder are loaded, health is NOT_SERVING and calls are UNAVAILABLE."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.runtime import free_port
from memory_service.builder import Service, ServiceBuilder
from memory_service.config import ServiceConfig


class SlowBuilder(ServiceBuilder):
    """The real builder whose build waits for the test's signal (a fake only of timing)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = asyncio.Event()

    async def build(self) -> Service:
        await self.release.wait()
        return await super().build()


async def test_calls_are_unavailable_and_health_not_serving_until_loaded(tmp_path, monkeypatch) -> None:
    import memory_service.server as server_module

    builders: list[SlowBuilder] = []

    def make_builder(*args, **kwargs):
        builders.append(SlowBuilder(*args, **kwargs))
        return builders[-1]

    monkeypatch.setattr(server_module, "ServiceBuilder", make_builder)
    config = ServiceConfig(data_dir=tmp_path / "data", host="127.0.0.1", port=free_port(), metrics_port=0)
    stop = asyncio.Event()
    serving = asyncio.create_task(server_module.serve(config, stop))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            await channel.channel_ready()
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.GetStats(pb.GetStatsRequest())
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE

            builders[0].release.set()
            for _ in range(600):
                status = (await health.Check(health_pb2.HealthCheckRequest())).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert (await stub.GetStats(pb.GetStatsRequest())).embedding_dim == 384
    finally:
        stop.set()
        await serving
