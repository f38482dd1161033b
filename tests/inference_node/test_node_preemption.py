"""Under a KV cache too small for the load, preempted and resumed injected requests, and requests admitted together
(their loads written in one batch), still answer right."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.inference_node import InferenceNodeProcess
from inferscale.v1 import memory_pb2 as pb
from tests.conftest import run_worker
from tests.inference_node.conftest import complete
from tests.stacks import Users

USERS = [Users(__name__)(f"busy-{i}") for i in range(8)]
QUESTION = "def answer(question):"
# Prompt ~190 tokens + 120 generated = 10 blocks of 32: one request fits the 15 usable blocks, two do not.
MAX_TOKENS = 120
BURSTS = 6


@pytest.fixture(scope="module")
def crowded_node(node_memory_service, node_stub, tiny_llama_dir, tmp_path_factory):
    for n, user in enumerate(USERS):
        node_stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
            pb.FactInput(fact_id=f"f{i}", text=f"User {n} fact {i}: likes item {n * 10 + i} a lot.")
            for i in range(6)]))
    run_worker(node_memory_service, tiny_llama_dir)
    # 16 blocks of 32 tokens: two of these requests fit at once, so growing ones preempt each other.
    root = tmp_path_factory.mktemp("crowded")
    process = InferenceNodeProcess(node_memory_service.address, tiny_llama_dir, root,
                                   "--load-stats-path", str(root / "loads.jsonl"),
                                   "--dtype", "float32", "--max-model-len", "384", "--block-size", "32",
                                   "--num-gpu-blocks-override", "16", "--max-num-seqs", "8",
                                   # 8 retrievals at once on a loaded 2-core box: this test is about preemption.
                                   "--retrieve-timeout-s", "60", "--kv-miss-policy", "wait").start()
    yield process
    process.stop()


def _preemptions(node: InferenceNodeProcess) -> float:
    with urllib.request.urlopen(f"{node.base_url}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("vllm:num_preemptions_total"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _assert_same_greedy_run(got, expected, label: str, tolerance: float = 1e-3) -> None:
    """Same tokens with the same logprobs; batched float32 arithmetic may reorder sums, so the two runs may part at
    a near-tie of the random model (both chosen tokens then have the same logprob), and are compared up to there."""
    for index, (token, want) in enumerate(zip(got.tokens, expected.tokens, strict=False)):
        difference = abs(got.logprobs[index] - expected.logprobs[index])
        assert difference <= tolerance, f"{label}: token {index}: logprob differs by {difference:.2e}"
        if token != want:
            break
    assert got.tokens[:1] == expected.tokens[:1], f"{label}: first token differs"


def _most_loads_in_one_step(node: InferenceNodeProcess) -> int:
    """The most loads the connector wrote in one engine step (its per-load records, --load-stats-path)."""
    records = (node.work_dir / "loads.jsonl").read_text().splitlines()
    return max((json.loads(line)["loads_in_step"] for line in records), default=0)


def test_every_preempted_injected_request_gives_its_unpreempted_answer(crowded_node) -> None:
    """Bursts of injected requests, until one preempted and one step admitted several loads (written in one batch):
    every answer is its answer alone."""
    # One at a time, each request fits: no preemption, one load per step. These are the right answers.
    expected = {user: complete(crowded_node, QUESTION, {"user_id": user, "mode": "kv"}, MAX_TOKENS)
                for user in USERS}
    assert _most_loads_in_one_step(crowded_node) == 1
    before = _preemptions(crowded_node)
    for _ in range(BURSTS):  # every burst must be right
        with ThreadPoolExecutor(max_workers=len(USERS)) as pool:
            injected = dict(zip(USERS, pool.map(
                lambda user: complete(crowded_node, QUESTION, {"user_id": user, "mode": "kv"}, MAX_TOKENS), USERS),
                                strict=True))
        for user in USERS:
            assert injected[user].summary.get("kv_facts") == 6, f"{user}: {injected[user].summary}"
            _assert_same_greedy_run(injected[user], expected[user], user)
        if _preemptions(crowded_node) > before and _most_loads_in_one_step(crowded_node) > 1:
            break
    assert _preemptions(crowded_node) > before, "the load did not cause any preemption"
    assert _most_loads_in_one_step(crowded_node) > 1, "no step admitted several injected requests"
