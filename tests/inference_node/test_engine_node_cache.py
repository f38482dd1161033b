"""The node cache as vLLM's engine sees it (real vLLM in one process, see engine_scenario.py): a synchronous load
never fetches, and anything the worker's cache lacks or holds stale is refused and recomputed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inferscale.v1 import memory_pb2 as pb
from tests.conftest import run_worker

USER = "engine-user"


@pytest.fixture(scope="module")
def scenario(node_memory_service, node_stub, tiny_llama_dir, tmp_path_factory) -> dict:
    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[
        pb.FactInput(fact_id="f0", text="Hana builds kites from bamboo and rice paper.")]))
    run_worker(node_memory_service, tiny_llama_dir)
    metrics = f"http://127.0.0.1:{node_memory_service.metrics_port}/metrics"
    work_dir = tmp_path_factory.mktemp("engine")
    result = subprocess.run(
        [sys.executable, "-m", "harness.engine_scenario", "service", node_memory_service.address,
         str(tiny_llama_dir), metrics, USER], capture_output=True, text=True, timeout=900, cwd=".",
        env={**__import__("os").environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(work_dir),
             "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (result.stdout[-3000:], result.stderr[-6000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def _equals_text(step: dict, text: dict) -> None:
    assert step["tokens"] == text["tokens"]
    assert max(abs(a - b) for a, b in zip(step["logprobs"], text["logprobs"], strict=False)) <= 1e-4


def test_a_cold_load_fetches_and_makes_its_chunks_resident(scenario) -> None:
    assert scenario["kv_facts"] == 1 and scenario["chunks"] == 2
    assert scenario["cold"]["fetches"] >= 1 and scenario["cold"]["external_tokens"] > 0
    assert all(scenario["cold"]["resident_after"])
    _equals_text(scenario["cold"], scenario["text"])


def test_a_chunk_the_directory_holds_resident_but_the_worker_lacks_is_recomputed_without_a_fetch(scenario) -> None:
    assert all(scenario["lost_resident_before"])  # so the load was synchronous
    assert scenario["lost"]["fetches"] == 0  # nothing on the engine thread reached the memory service
    _equals_text(scenario["lost"], scenario["text"])
    assert not any(scenario["lost"]["resident_after"])  # no longer trusted: the next load goes async
    assert scenario["refetch"]["fetches"] >= 1 and all(scenario["refetch"]["resident_after"])
    _equals_text(scenario["refetch"], scenario["text"])


def test_a_stale_entry_shorter_than_its_chunk_is_refused_and_recomputed(scenario) -> None:
    assert all(scenario["stale_resident_before"]) and scenario["stale"]["fetches"] == 0
    _equals_text(scenario["stale"], scenario["text"])


def test_every_refused_load_is_reported_to_vllm(scenario) -> None:
    assert scenario["cold"]["loads_refused"] == 0 and scenario["refetch"]["loads_refused"] == 0
    assert scenario["lost"]["loads_refused"] == 1 and scenario["stale"]["loads_refused"] == 1
