"""The OpenAI `memory` field's `retrieval` and `max_tokens` through the middleware, against a real memory service
(a recording ASGI app stands in for vLLM): the mode reaches RetrieveAndStage, the token cap keeps the best-ranked facts
whose lines fit, and a bad value is a 400 naming the field that reaches neither the service nor vLLM."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from inference_node.middleware import MemoryMiddleware
from inference_node.settings import SETTINGS_ENV, NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import fact_token_ids
from inferscale_kv.model_profile import build_model_profile

USER = "mw-retrieval"
DOG_FACTS = ["Caroline's dog Max loves the beach.", "Caroline walks her dog every morning.",
             "Caroline's dog is a golden retriever.", "Caroline bought her dog a new red collar."]
PARCEL = "Parcel QJ-7731 shipped on Tuesday."
QUESTION = "What did Caroline say about her dog and parcel QJ-7731?"


class RecordingApp:
    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        self.bodies.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


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
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json")]}
    served.loop.run_until_complete(served.middleware(scope, receive, send))
    headers = dict(sent[0]["headers"])
    summary = json.loads(headers[b"x-inferscale-memory"]) if b"x-inferscale-memory" in headers else {}
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:])), summary


def _memory_block(app: RecordingApp) -> str:
    return app.bodies[-1]["messages"][0]["content"]


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
