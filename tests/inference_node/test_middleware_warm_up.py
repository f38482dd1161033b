"""A user's warm-up and a kv answer's summary through the middleware, against a real memory service with real KV (a
recording ASGI app stands in for vLLM): a user's first kv request asks RetrieveAndStage for --warm-facts more facts,
places only its own top_k, and signs the rest into the plan as a warm-up the connector verifies; the next request of
the user asks for none. A non-streamed kv answer's x-inferscale-memory says what the connector did with the memory."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from inference_node.middleware import MemoryMiddleware
from inference_node.plan import PlanSigner
from inference_node.settings import SETTINGS_ENV, NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from tests.conftest import run_worker
from tests.inference_node.asgi import RecordingApp, asgi_request
from tests.stacks import Users

user = Users(__name__)
FACTS = [f"Mira keeps note {index}: the blue door code is {1000 + index}." for index in range(6)]


@pytest.fixture(scope="module")
def users_with_kv(node_memory_service, node_stub, tiny_llama_dir) -> tuple[str, str, str]:
    users = user("warm-a"), user("warm-b"), user("warm-c")
    for user_id in users:
        node_stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
            pb.FactInput(fact_id=f"f{index}", text=text) for index, text in enumerate(FACTS)]))
    run_worker(node_memory_service, tiny_llama_dir)
    return users


@pytest.fixture
def middleware(monkeypatch, node_plan_secret, node_memory_service, tiny_llama_dir, users_with_kv):
    from transformers import AutoTokenizer

    profile = build_model_profile(tiny_llama_dir, AutoTokenizer.from_pretrained(tiny_llama_dir), "float32",
                                  DEFAULT_CONTEXT_WINDOW).as_dict()
    settings = NodeSettings(memory_service=node_memory_service.address, node_id="n", model_dir=str(tiny_llama_dir),
                            profile=profile, warm_facts=3)
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    app = RecordingApp()
    loop = asyncio.new_event_loop()
    yield MemoryMiddleware(app), app, loop, PlanSigner(node_plan_secret)
    loop.close()


def _ask(middleware, loop, user_id: str, mode: str = "kv") -> dict:
    body = {"model": "m", "prompt": "What is the blue door code?", "max_tokens": 1,
            "memory": {"user_id": user_id, "mode": mode, "top_k": 2}}
    answer = asgi_request(middleware, [json.dumps(body).encode()], path="/v1/completions", loop=loop)
    assert answer.status == 200
    return json.loads(answer.headers[b"x-inferscale-memory"])


def test_a_users_first_kv_request_signs_a_warm_up_of_its_next_facts_and_later_ones_none(middleware,
                                                                                       users_with_kv) -> None:
    node, app, loop, signer = middleware
    first, second, _ = users_with_kv
    summary = _ask(node, loop, first)
    assert summary["facts"] == 2 and summary["kv_facts"] == 2  # the request's own top_k, nothing more
    params = app.json()["kv_transfer_params"]
    plan, warm_up = signer.verified(params), signer.verified_warm_up(params)
    assert plan is not None and len(warm_up) == 3  # --warm-facts 3 of the 4 others
    assert not {fact.fact_id for fact in warm_up} & {fact.fact_id for fact in plan.facts}
    assert all(fact.token_ids and len(fact.content_id) == 32 for fact in warm_up)
    _ask(node, loop, first)
    assert signer.verified(app.json()["kv_transfer_params"]) is not None
    assert signer.verified_warm_up(app.json()["kv_transfer_params"]) == ()  # warmed lately: none
    _ask(node, loop, second)  # another user: its own
    assert len(signer.verified_warm_up(app.json()["kv_transfer_params"])) == 3
    forged = dict(params["inferscale"], warm=params["inferscale"]["warm"][:1])
    assert signer.verified_warm_up({"inferscale": forged}) == ()  # altered: not the middleware's


def test_a_text_request_neither_carries_nor_uses_up_a_warm_up(middleware, users_with_kv) -> None:
    node, app, loop, signer = middleware
    third = users_with_kv[2]
    summary = _ask(node, loop, third, mode="text")
    assert summary["facts"] == 2 and "kv_transfer_params" not in app.json()
    _ask(node, loop, third)  # the user's first kv request still warms up
    assert len(signer.verified_warm_up(app.json()["kv_transfer_params"])) == 3


@pytest.mark.parametrize(("answer", "stream", "said"), [
    (b'{"choices":[],"kv_transfer_params":{"inferscale_load":{"outcome":"waited","tokens_loaded":120}}}', False,
     {"load": "waited", "tokens_loaded": 120}),
    (b'{"choices":[],"kv_transfer_params":{"inferscale_load":{"outcome":"waited","tokens_loaded":120}}}', True, {}),
    (b'{"choices":[{"text":"inferscale_load"}]}', False, {}),  # in the generated text: not the connector's
    (b'{"kv_transfer_params":{"inferscale_load":{"outcome":1}}}', False, {}),
    (b'not json, inferscale_load', False, {}),
])
def test_the_summary_of_a_non_streamed_kv_answer_says_what_became_of_its_memory(middleware, users_with_kv, answer,
                                                                                stream, said) -> None:
    node, app, loop, _ = middleware
    app.answer = answer
    body = {"model": "m", "prompt": "What is the blue door code?", "max_tokens": 1, "stream": stream,
            "memory": {"user_id": users_with_kv[0], "mode": "kv", "top_k": 2}}
    response = asgi_request(node, [json.dumps(body).encode()], path="/v1/completions", loop=loop)
    summary = json.loads(response.headers[b"x-inferscale-memory"])
    assert response.body == answer and summary["kv_facts"] == 2
    assert {key: summary[key] for key in ("load", "tokens_loaded") if key in summary} == said


class CappedService:
    """The real memory service behind a --max-top-k of `limit` (refused as the service refuses it)."""

    def __init__(self, inner, limit: int) -> None:
        self.inner, self.limit, self.asked = inner, limit, list[int]()

    async def RetrieveAndStage(self, request, timeout, metadata):
        self.asked.append(request.top_k)
        if request.top_k > self.limit:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=f"top_k: {request.top_k} exceeds the limit of {self.limit}")
        return await self.inner.RetrieveAndStage(request, timeout=timeout, metadata=metadata)


def test_a_service_that_refuses_the_warm_up_still_serves_the_requests_own_top_k(middleware, users_with_kv) -> None:
    """Review of issue 41: the warm-up's top_k past the service's --max-top-k was refused as the request's own
    top_k (a 400 for a valid request); and the user counted as warmed up all the same."""
    node, app, loop, signer = middleware
    user_id = users_with_kv[2] + "-capped"
    _ask(node, loop, user_id, mode="text")  # the channel to the service opens on the middleware's loop
    batcher = node._retriever._connected()
    service = batcher._stub = CappedService(batcher._stub, limit=4)
    for _ in range(2):
        summary = _ask(node, loop, user_id, mode="text")
        assert summary["facts"] == 0  # (no facts under this name: the calls are what is looked at)
    assert service.asked == [2, 2]  # text: no warm-up
    _ask(node, loop, users_with_kv[1])
    _ask(node, loop, users_with_kv[1])
    assert service.asked[2:] == [5, 2, 5, 2]  # refused with the warm-up, served without; asked again next time
    assert signer.verified(app.json()["kv_transfer_params"]) is not None
    assert signer.verified_warm_up(app.json()["kv_transfer_params"]) == ()
