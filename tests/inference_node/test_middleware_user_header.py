"""The middleware binds memory.user_id to the gateway's user header when --user-header is set. A recording ASGI app
stands in for vLLM (the real node's HTTP behaviour is in test_node_http)."""

from __future__ import annotations

import json

import pytest

from inference_node.middleware import MemoryMiddleware
from inference_node.settings import SETTINGS_ENV, NodeSettings
from tests.inference_node.asgi import RecordingApp, asgi_request

PROFILE = {"profile_id": "p", "model": "m", "kv_dtype": "float32"}


def _post(middleware: MemoryMiddleware, body: dict, headers: list[tuple[bytes, bytes]]) -> int:
    return asgi_request(middleware, [json.dumps(body).encode()], headers, "/v1/chat/completions").status


@pytest.fixture
def guarded(monkeypatch, node_plan_secret) -> tuple[MemoryMiddleware, RecordingApp]:
    settings = NodeSettings(memory_service="127.0.0.1:1", node_id="n", model_dir="/nonexistent", profile=PROFILE,
                            user_header="x-authenticated-user")
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    app = RecordingApp()
    return MemoryMiddleware(app), app


def _request(user_id: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "memory": {"user_id": user_id, "mode": "off"}}


def test_a_request_naming_another_user_than_the_gateway_header_is_refused_before_vllm(guarded):
    middleware, app = guarded
    assert _post(middleware, _request("globex/ana"), [(b"x-authenticated-user", b"acme/maya")]) == 403
    assert _post(middleware, _request("acme/maya"), []) == 403
    assert app.bodies == []


def test_a_request_naming_the_gateway_users_own_memory_is_served(guarded):
    middleware, app = guarded
    assert _post(middleware, _request("acme/maya"), [(b"X-Authenticated-User", b"acme/maya")]) == 200
    assert len(app.bodies) == 1 and "memory" not in app.json(0)


def test_a_request_carrying_the_user_header_twice_is_refused(guarded):
    """Regression: the first copy was believed; a gateway that appends its own header (Envoy's default) instead of
    replacing the client's left the client's copy first, naming any user it liked."""
    middleware, app = guarded
    headers = [(b"x-authenticated-user", b"acme/maya"), (b"x-authenticated-user", b"globex/ana")]
    assert _post(middleware, _request("acme/maya"), headers) == 403
    assert _post(middleware, _request("acme/maya"), [(b"x-authenticated-user", b"acme/maya")] * 2) == 403
    assert app.bodies == []
