"""A node started with --embed-queries-locally embeds each query itself: the memory service receives the vector,
embeds nothing, and the memory reaches the prompt as before."""

from __future__ import annotations

import urllib.request

import pytest

from harness.inference_node import InferenceNodeProcess
from inferscale.v1 import memory_pb2 as pb
from tests.conftest import run_worker
from tests.inference_node.conftest import complete
from tests.stacks import NODE_FLAGS, Users

QUESTION = "def answer(question):"
USER = Users(__name__)("local-embed")


def _service_metric(service, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10) as response:
        return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                   if line.startswith(name))


@pytest.fixture(scope="module")
def node(node_memory_service, node_stub, tiny_llama_dir, tmp_path_factory):
    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[
        pb.FactInput(fact_id="f0", text="Ida grows lemons on her balcony.")]))
    run_worker(node_memory_service, tiny_llama_dir)
    process = InferenceNodeProcess(node_memory_service.address, tiny_llama_dir, tmp_path_factory.mktemp("embed-node"),
                                   *NODE_FLAGS, "--embed-queries-locally").start()
    yield process
    process.stop()


def test_the_node_sends_its_own_query_vector_and_the_memory_reaches_the_prompt(node, node_memory_service) -> None:
    embedded_by_caller = _service_metric(node_memory_service, "inferscale_caller_embedded_queries_total")
    kv = complete(node, QUESTION, {"user_id": USER, "mode": "kv"})
    text = complete(node, QUESTION, {"user_id": USER, "mode": "text"})
    assert kv.summary["facts"] == 1 and kv.summary["kv_facts"] == 1 and "error" not in kv.summary
    assert kv.tokens == text.tokens
    assert _service_metric(node_memory_service, "inferscale_caller_embedded_queries_total") == embedded_by_caller + 2
