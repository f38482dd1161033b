"""Every way a synchronous load could be refused or diverge, injected into real vLLM in one process (see
harness/engine_scenario.py; the memory service is real): each output equals the same prompt prefilled as text, or,
for a defect, the request fails with an error and the engine serves the next one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from inferscale.v1 import memory_pb2 as pb
from tests.conftest import run_worker
from tests.stacks import Users

user = Users(__name__)
USER = user("engine-user")
BLOCK_SIZE = 32  # the scenario's


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
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(work_dir),
             "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (result.stdout[-3000:], result.stderr[-6000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


def _equals(step: dict, reference: dict) -> None:
    assert step["finish_reason"] == reference["finish_reason"] == "length"
    assert step["tokens"] == reference["tokens"]
    assert max(abs(a - b) for a, b in zip(step["logprobs"], reference["logprobs"], strict=True)) <= 1e-4


STEPS = ("cold", "warm", "shared", "shared_1", "intruder", "partial_hit", "full_prompt", "mismatch", "fetch_fails",
         "fetch_slow", "aborted", "lost", "after_lost", "stale", "after_stale", "device_error", "after_device_error",
         "host_warm", "from_host", "best_effort", "auto_slow", "auto_fast")


def test_no_load_is_ever_async_and_only_fetch_threads_fetch(scenario) -> None:
    assert scenario["kv_facts"] == 1 and scenario["chunks"] == 2
    assert not any(scenario[step]["async"] for step in STEPS)  # never WAITING_FOR_REMOTE_KVS
    assert scenario["fetch_threads"] and all(name.startswith(("inferscale-fetch", "inferscale-warm"))
                                             for name in scenario["fetch_threads"])


def test_a_cold_request_waits_for_its_prefetch_then_loads_synchronously(scenario) -> None:
    cold = scenario["cold"]
    assert cold["waits"] >= 1 and cold["claims"] == [scenario["memory_tokens"]] and cold["fetches"] >= 1
    assert all(cold["resident_after"]) and cold["admitted_after"] > 1
    _equals(cold, scenario["text"])


def test_a_warm_request_is_admitted_with_its_load_in_its_first_step_like_one_without_memory(scenario) -> None:
    warm, off = scenario["warm"], scenario["off"]
    assert warm["waits"] == 0 and warm["claims"] == [scenario["memory_tokens"]] and warm["fetches"] == 0
    assert warm["admitted_after"] == off["admitted_after"] == 1
    _equals(warm, scenario["text"])


def test_requests_sharing_chunks_wait_for_one_prefetch(scenario) -> None:
    assert scenario["shared"]["fetch_attempts"] == 1 and scenario["shared"]["waits"] >= 1
    for step in ("shared", "shared_1"):
        _equals(scenario[step], scenario["text"])


def test_chunks_answered_for_are_not_evicted_before_their_load(scenario) -> None:
    assert scenario["intruder_admitted"] is False
    assert scenario["intruder"]["claims"] == [scenario["memory_tokens"]]
    _equals(scenario["intruder"], scenario["text"])


def test_a_load_starting_inside_a_chunk_after_vllms_prefix_cache_hit(scenario) -> None:
    (claim,) = scenario["partial_hit"]["claims"]
    assert claim == scenario["memory_tokens"] - BLOCK_SIZE > 0
    _equals(scenario["partial_hit"], scenario["text_other"])


def test_a_prompt_that_is_all_memory_claims_all_but_its_last_token(scenario) -> None:
    assert scenario["full_prompt"]["claims"] == [scenario["memory_tokens"] - 1]
    _equals(scenario["full_prompt"], scenario["text_full_prompt"])


def test_a_resident_key_named_with_other_token_ids_is_not_claimed(scenario) -> None:
    assert scenario["mismatch"]["claims"] == [0] and scenario["mismatch"]["fetch_attempts"] == 0
    _equals(scenario["mismatch"], scenario["text_mismatch"])


def test_a_prefetch_that_fails_or_outlasts_the_wait_leaves_the_request_to_vllms_prefill(scenario) -> None:
    for step in ("fetch_fails", "fetch_slow"):
        assert scenario[step]["waits"] >= 1 and scenario[step]["claims"] == [0], step
        assert not any(scenario[step]["resident_after"])
        _equals(scenario[step], scenario["text"])
    assert all(scenario["fetch_slow_resident_later"])  # the slow fetch still settled


def test_a_request_aborted_while_its_prefetch_runs_leaves_the_fetch_to_the_next_one(scenario) -> None:
    assert all(scenario["aborted_fetching"]) and scenario["aborted_holds"] == 0
    aborted = scenario["aborted"]
    assert aborted["fetch_attempts"] == 0 and aborted["waits"] >= 1  # waited for the aborted request's fetch
    _equals(aborted, scenario["text"])


@pytest.mark.parametrize("defect", ["lost", "stale", "device_error"])
def test_a_defect_fails_its_request_and_the_next_one_fetches_again_and_loads(scenario, defect) -> None:
    if defect != "device_error":
        assert all(scenario[f"{defect}_resident_before"])  # so the load was declared
    failed = scenario[defect]
    assert failed["finish_reason"] == "error" and failed["tokens"] == [] and failed["fetches"] == 0
    after = scenario[f"after_{defect}"]
    assert after["fetches"] >= 1 and after["claims"] == [scenario["memory_tokens"]]
    _equals(after, scenario["text"])


def test_a_chunk_the_device_tier_evicted_comes_back_from_the_host_tier_without_a_fetch_or_a_wait(scenario) -> None:
    """Copied back in the step that admits the request, before its load, as a warm request is admitted."""
    assert all(scenario["on_host_before"])
    from_host = scenario["from_host"]
    assert from_host["waits"] == 0 and from_host["admitted_after"] == 1
    assert from_host["claims"] == [scenario["memory_tokens"]]
    assert from_host["fetch_attempts"] == 0 and from_host["fetches"] == 0 and all(from_host["resident_after"])
    _equals(from_host, scenario["text"])


@pytest.mark.parametrize("step", ["best_effort", "auto_slow"])
def test_a_request_served_at_once_loads_its_resident_header_prefills_its_fact_and_fetches_it_for_later(
        scenario, step) -> None:
    served = scenario[step]
    header_tokens = scenario["memory_tokens"] - scenario["fact_tokens"]
    assert served["waits"] == 0 and served["claims"] == [header_tokens] and served["admitted_after"] == 1
    _equals(served, scenario["text"])
    # The fact, fetched in the background into the host tier (one copy away for the user's next request).
    assert scenario[f"{step}_on_host_later"][-1]


def test_auto_waits_for_bytes_that_come_faster_than_their_prefill(scenario) -> None:
    waited = scenario["auto_fast"]
    assert waited["waits"] >= 1 and waited["claims"] == [scenario["memory_tokens"]] and waited["fetch_attempts"] == 1
    _equals(waited, scenario["text"])
