"""The OpenAI `memory` field's `retrieval` and `max_tokens` through the middleware, against a real memory service
(a recording ASGI app stands in for vLLM): the mode reaches RetrieveAndStage, the token cap keeps the best-ranked facts
whose lines fit, and a bad value is a 400 naming the field that reaches neither the service nor vLLM."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import REGISTRY

from inference_node.middleware import MemoryMiddleware
from inference_node.retrieval import DROP_DEADLINE, DROP_ERROR, DROP_REASONS, DROP_UNAVAILABLE, RetrievalBatcher
from inference_node.settings import SETTINGS_ENV, NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import fact_token_ids
from inferscale_kv.limits import MAX_SEARCH_TOP_K
from inferscale_kv.model_profile import build_model_profile
from tests.inference_node.asgi import RecordingApp, asgi_request
from tests.stacks import Users

user = Users(__name__)
USER = user("mw-retrieval")
DOG_FACTS = ["Caroline's dog Max loves the beach.", "Caroline walks her dog every morning.",
             "Caroline's dog is a golden retriever.", "Caroline bought her dog a new red collar."]
PARCEL = "Parcel QJ-7731 shipped on Tuesday."
QUESTION = "What did Caroline say about her dog and parcel QJ-7731?"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def served(monkeypatch, node_plan_secret, memory_service, stub, tiny_llama_dir, tokenizer):
    stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[
        *(pb.FactInput(fact_id=f"dog{i}", text=text) for i, text in enumerate(DOG_FACTS)),
        pb.FactInput(fact_id="parcel", text=PARCEL)]))
    profile = build_model_profile(tiny_llama_dir, tokenizer, "float32", 0).as_dict()
    settings = NodeSettings(memory_service=memory_service.address, node_id="n", model_dir=str(tiny_llama_dir),
                            profile=profile)
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    app = RecordingApp()
    loop = asyncio.new_event_loop()  # the middleware's channel to the memory service lives on one loop
    yield Served(MemoryMiddleware(app), loop), app
    loop.close()


@dataclass(frozen=True)
class Served:
    middleware: MemoryMiddleware
    loop: asyncio.AbstractEventLoop


def _chat(served: Served, memory: dict) -> tuple[int, dict, dict]:
    """(status, JSON answer, x-inferscale-memory summary or {}) of one chat request with `memory`."""
    body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}],
            "memory": {"user_id": USER, "mode": "text", **memory}}
    answer = asgi_request(served.middleware, [json.dumps(body).encode()], path="/v1/chat/completions",
                          loop=served.loop)
    summary = answer.headers.get(b"x-inferscale-memory")
    return answer.status, answer.json(), json.loads(summary) if summary else {}


def _memory_block(app: RecordingApp) -> str:
    return app.json()["messages"][0]["content"]


def test_the_requested_retrieval_mode_ranks_the_memory(served) -> None:
    middleware, app = served
    assert _chat(middleware, {"top_k": 2, "retrieval": "vector"})[0] == 200
    assert PARCEL not in _memory_block(app)
    assert _chat(middleware, {"top_k": 2, "retrieval": "keyword"})[0] == 200
    assert PARCEL in _memory_block(app)


def test_max_tokens_keeps_the_best_ranked_facts_whose_lines_fit(served, stub, tokenizer) -> None:
    middleware, app = served
    ranked = [scored.fact.text for scored in stub.SearchFacts(pb.SearchFactsRequest(
        user_id=USER, query=QUESTION, top_k=5, retrieval=pb.RETRIEVAL_MODE_HYBRID)).facts]
    budget = sum(len(fact_token_ids(tokenizer, text)) for text in ranked[:2])
    status, _, summary = _chat(middleware, {"top_k": 5, "retrieval": "hybrid", "max_tokens": budget})
    assert status == 200 and (summary["facts"], summary["facts_retrieved"]) == (2, 5)
    block = _memory_block(app)
    assert all(text in block for text in ranked[:2]) and not any(text in block for text in ranked[2:])
    status, _, summary = _chat(middleware, {"top_k": 5, "retrieval": "hybrid", "max_tokens": budget - 1})
    block = _memory_block(app)  # the second-best no longer fits; a shorter fact after it may
    assert status == 200 and ranked[0] in block and ranked[1] not in block


@pytest.mark.parametrize(("memory", "field"), [
    ({"retrieval": "bm25"}, "memory.retrieval"), ({"retrieval": 2}, "memory.retrieval"),
    ({"retrieval": None}, "memory.retrieval"), ({"max_tokens": -1}, "memory.max_tokens"),
    ({"max_tokens": "64"}, "memory.max_tokens"), ({"max_tokens": 1.5}, "memory.max_tokens"),
    ({"max_tokens": True}, "memory.max_tokens"), ({"max_tokens": 1 << 21}, "memory.max_tokens"),
])
def test_a_bad_retrieval_or_max_tokens_is_a_400_naming_it_that_reaches_neither_vllm_nor_the_service(
        served, memory, field) -> None:
    middleware, app = served
    status, answer, summary = _chat(middleware, memory)
    assert status == 400 and answer["error"]["message"].startswith(f"{field}:") and not summary
    assert app.bodies == []


def _dropped() -> dict[str, float]:
    return {reason: REGISTRY.get_sample_value("inferscale_node_memory_dropped_total", {"reason": reason}) or 0.0
            for reason in DROP_REASONS}


@pytest.fixture
def node_allowing_more_facts(served, monkeypatch) -> Served:
    """A node whose own top_k limit is past the memory service's (--max-top-k, MAX_SEARCH_TOP_K by default)."""
    middleware, _ = served
    monkeypatch.setenv(SETTINGS_ENV, dataclasses.replace(middleware.middleware.settings, max_top_k=5000).to_json())
    return Served(MemoryMiddleware(RecordingApp()), middleware.loop)


def test_a_top_k_the_memory_service_refuses_is_a_400_naming_it_not_an_answer_without_memory(
        node_allowing_more_facts) -> None:
    """Regression (issue 31 review, L3): any RetrieveAndStage error was answered 200 without the memory; the service
    refusing what the request asked (here RESOURCE_EXHAUSTED: a top_k past its --max-top-k) is the client's to fix."""
    dropped = _dropped()
    status, answer, summary = _chat(node_allowing_more_facts, {"top_k": 2000})
    assert status == 400 and not summary
    message = answer["error"]["message"]
    assert message.startswith("memory.top_k: the memory service refused it (RESOURCE_EXHAUSTED: top_k:"), message
    assert str(MAX_SEARCH_TOP_K) in message
    assert _dropped() == dropped


class RefusingStub:
    """A memory service that fails every RetrieveAndStage with one status, and counts the calls."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details, self.calls = code, details, 0

    async def RetrieveAndStage(self, request, timeout, metadata):
        self.calls += 1
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=self.details)


def _refusing(served: Served, code: grpc.StatusCode, details: str) -> RefusingStub:
    """Puts a RefusingStub in place of the middleware's memory service."""
    stub = RefusingStub(code, details)
    served.middleware._retriever._batcher = RetrievalBatcher(stub, (), 5.0)  # type: ignore[arg-type]
    return stub


def test_a_node_that_cannot_load_its_tokenizer_answers_500_and_asks_the_memory_service_nothing(
        served, monkeypatch) -> None:
    """Regression (issue 40 review): with the middleware split, the tokenizer was loaded after RetrieveAndStage, so a
    node that cannot load it asked the service for every request (announcing its profile, queueing KV work) and then
    answered 500, or 200 without memory where the call failed."""
    middleware, _ = served
    monkeypatch.setenv(SETTINGS_ENV, dataclasses.replace(middleware.middleware.settings,
                                                         model_dir="/nonexistent").to_json())
    app = RecordingApp()
    broken = Served(MemoryMiddleware(app), middleware.loop)
    service = _refusing(broken, grpc.StatusCode.UNAVAILABLE, "no replica answered")
    status, answer, summary = _chat(broken, {})
    assert status == 500 and "request id" in answer["error"]["message"] and not summary
    assert service.calls == 0 and app.bodies == []


@pytest.mark.parametrize(("code", "details", "field"), [
    (grpc.StatusCode.INVALID_ARGUMENT, "user_id: too long", "memory.user_id"),
    (grpc.StatusCode.INVALID_ARGUMENT, "retrieval: 7 is not a RetrievalMode", "memory.retrieval"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "query: longer than 100 characters", "messages"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "top_k: 50 exceeds the limit of 20", "memory.top_k"),
])
def test_a_value_of_the_request_the_memory_service_refuses_is_a_400_naming_the_requests_field(
        served, code, details, field) -> None:
    middleware, app = served
    _refusing(middleware, code, details)
    dropped = _dropped()
    status, answer, summary = _chat(middleware, {})
    assert status == 400 and not summary and app.bodies == []
    assert answer["error"]["message"] == f"{field}: the memory service refused it ({code.name}: {details})"
    assert _dropped() == dropped


@pytest.mark.parametrize(("code", "details", "reason"), [
    (grpc.StatusCode.UNAVAILABLE, "no replica answered", DROP_UNAVAILABLE),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", DROP_DEADLINE),
    (grpc.StatusCode.INTERNAL, "the service failed", DROP_ERROR),
    (grpc.StatusCode.PERMISSION_DENIED, "the node's credential may not call RetrieveAndStage", DROP_ERROR),
    # The node's own configuration, not the request: its profile or query embedder disagreeing with the service.
    (grpc.StatusCode.INVALID_ARGUMENT, "profile.kv_dtype: 'float7' is not one of float32, bfloat16", DROP_ERROR),
    (grpc.StatusCode.INVALID_ARGUMENT, "query_vector: has 3 values; the model's vectors have 384", DROP_ERROR),
])
def test_a_failure_that_is_not_the_requests_answers_without_memory_and_says_so(served, code, details,
                                                                                reason) -> None:
    middleware, app = served
    _refusing(middleware, code, details)
    dropped = _dropped()
    status, _, summary = _chat(middleware, {})
    assert status == 200 and len(app.bodies) == 1
    assert (summary["memory"], summary["reason"], summary["error"]) == ("dropped", reason,
                                                                         f"memory service: {code.name}")
    assert _dropped() == {**dropped, reason: dropped[reason] + 1}


def test_a_second_request_does_not_recompute_the_facts_neutral_lines(served, neutralized) -> None:
    """Regression (issue 31 review, L1): every request made each retrieved fact neutral again (StoredTextGuard
    .neutral), on vLLM's event loop: a hostile 2,000-character fact costs milliseconds. The node remembers each
    fact's line; the memory block stays the same."""
    middleware, app = served
    assert _chat(middleware, {})[0] == 200
    first_block = _memory_block(app)
    fact_texts = {*DOG_FACTS, PARCEL}
    neutralized.clear()  # counted from here
    assert _chat(middleware, {})[0] == 200
    assert _memory_block(app) == first_block
    assert fact_texts & set(first_block.splitlines())  # the facts are in the block
    assert [text for text in neutralized if text in fact_texts] == []
