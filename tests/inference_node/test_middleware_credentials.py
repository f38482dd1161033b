"""The middleware presents the node's credential (INFERSCALE_NODE_MEMORY_SERVICE_TOKEN) to a memory service with
access control on: with it the user's facts reach the prompt; without it the request is answered without memory.
A real memory service; a recording ASGI app stands in for vLLM (the node's real HTTP path is in test_node_http)."""

from __future__ import annotations

import asyncio
import json
from typing import cast

import pytest
from transformers import AutoTokenizer

from inference_node.middleware import SUMMARY_HEADER, MemoryMiddleware
from inference_node.settings import SETTINGS_ENV, NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import NODE_TOKEN_ENV
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from tests.conftest import own_memory_service
from tests.memory_service.test_access import CREDENTIALS, TOKENS, _metadata, _write


@pytest.fixture(scope="module")
def guarded_service(tmp_path_factory):
    credentials = _write(tmp_path_factory.mktemp("credentials"), cast(list[dict], CREDENTIALS))
    with own_memory_service(tmp_path_factory, "guarded-node", "--auth-file", str(credentials)) as service:
        with service.channel() as channel:
            memory_pb2_grpc.MemoryServiceStub(channel).IngestFacts(pb.IngestFactsRequest(
                user_id="acme/maya", facts=[pb.FactInput(text="Maya has a cat named Pimenta.")]),
                metadata=_metadata("acme-app"))
        yield service


def _serve_one(guarded_service, tiny_llama_dir, monkeypatch) -> tuple[dict, dict]:
    """One text-mode chat request for acme/maya through the middleware: (body vLLM got, memory summary)."""
    profile = build_model_profile(tiny_llama_dir, AutoTokenizer.from_pretrained(tiny_llama_dir), "float32",
                                  DEFAULT_CONTEXT_WINDOW)
    settings = NodeSettings(memory_service=guarded_service.address, node_id="node-1", model_dir=str(tiny_llama_dir),
                            profile=profile.as_dict(), retrieve_timeout_s=30)
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    received: list[dict] = []
    sent: list[dict] = []

    async def vllm(scope, receive, send) -> None:
        received.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    body = {"model": "m", "messages": [{"role": "user", "content": "What is my cat called?"}],
            "memory": {"user_id": "acme/maya", "mode": "text"}}
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(MemoryMiddleware(vllm)(scope, receive, send))
    summary = json.loads(dict(sent[0]["headers"])[SUMMARY_HEADER])
    return received[0], summary


def test_with_the_node_token_the_users_facts_reach_the_prompt(guarded_service, tiny_llama_dir, monkeypatch,
                                                            node_plan_secret):
    monkeypatch.setenv(NODE_TOKEN_ENV, TOKENS["nodes"])
    forwarded, summary = _serve_one(guarded_service, tiny_llama_dir, monkeypatch)
    assert "error" not in summary and summary["facts"] == 1
    assert "Pimenta" in forwarded["messages"][0]["content"]


def test_without_a_token_the_request_is_answered_without_memory(guarded_service, tiny_llama_dir, monkeypatch,
                                                               node_plan_secret):
    monkeypatch.delenv(NODE_TOKEN_ENV, raising=False)
    forwarded, summary = _serve_one(guarded_service, tiny_llama_dir, monkeypatch)
    assert summary["error"] == "memory service: UNAUTHENTICATED"
    assert all("Pimenta" not in str(message.get("content")) for message in forwarded["messages"])


def test_a_node_without_the_user_token_header_drops_the_memory_instead_of_blaming_the_request(
        user_bound_service, tiny_llama_dir, monkeypatch, node_plan_secret):
    """A service binding node reads to user tokens, a node not told to forward them (--user-token-header unset): the
    node's configuration is at fault, so the request is answered without memory (reason error), not refused 403."""
    monkeypatch.setenv(NODE_TOKEN_ENV, TOKENS["nodes"])
    forwarded, summary = _serve_one(user_bound_service, tiny_llama_dir, monkeypatch)
    assert summary["error"] == "memory service: PERMISSION_DENIED"
    assert all("Maya" not in str(message.get("content")) for message in forwarded["messages"])
