"""Shared test fixtures: a real memory service process on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inferscale.v1 import memory_pb2_grpc
from memory_service.launcher import MemoryServiceProcess


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryServiceProcess]:
    """One real memory service per test module, on its own data directory."""
    root = tmp_path_factory.mktemp("memory_service")
    service = MemoryServiceProcess(root / "data", root / "service.log").start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def stub(memory_service: MemoryServiceProcess) -> Iterator[memory_pb2_grpc.MemoryServiceStub]:
    with memory_service.channel() as channel:
        yield memory_pb2_grpc.MemoryServiceStub(channel)
