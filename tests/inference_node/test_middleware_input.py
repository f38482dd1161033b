"""What the middleware answers itself, before vLLM or the memory service sees a request: bodies it cannot read (too
large, not JSON though they say so, nested past the parser), and its own failures (a 500 naming the request id, which
the log names too). A recording ASGI app stands in for vLLM (through the real node: test_node_input)."""

from __future__ import annotations

import logging

import pytest

from inference_node import middleware as middleware_module
from inference_node.middleware import MAX_BODY_BYTES, MemoryMiddleware
from inference_node.settings import SETTINGS_ENV, NodeSettings
from tests.inference_node.asgi import RecordingApp, asgi_request

PROFILE = {"profile_id": "p", "model": "m", "kv_dtype": "float32"}


@pytest.fixture
def served(monkeypatch, node_plan_secret) -> tuple[MemoryMiddleware, RecordingApp]:
    settings = NodeSettings(memory_service="127.0.0.1:1", node_id="n", model_dir="/nonexistent", profile=PROFILE)
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    app = RecordingApp()
    return MemoryMiddleware(app), app


def _request(middleware: MemoryMiddleware, chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None,
             path: str = "/v1/completions", method: str = "POST") -> tuple[int, dict, dict]:
    """(status, JSON body or {}, response headers) of one request (a POST unless `method` says) whose body arrives
    in `chunks`."""
    answer = asgi_request(middleware, chunks, headers, path, method)
    return answer.status, answer.json(), answer.headers


def test_a_body_past_the_limit_is_a_413_before_it_is_buffered(served) -> None:
    middleware, app = served
    chunk = b" " * (1 << 20)
    status, body, _ = _request(middleware, [b'{"prompt": "x"'] + [chunk] * ((MAX_BODY_BYTES >> 20) + 2) + [b"}"])
    assert status == 413 and body["error"]["message"].startswith("body: larger than")
    assert app.bodies == []


@pytest.mark.parametrize(("raw", "expected"), [
    (b'{"model": ', "body: not valid JSON"),
    (b'{"model": "\xff\xfe"}', "body: not valid JSON"),
    (b"[" * 5000 + b"]" * 5000, "body: nested too deeply"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "body: not valid JSON"),
])
def test_a_body_that_does_not_parse_is_a_400_naming_the_body(served, raw, expected) -> None:
    middleware, app = served
    status, body, headers = _request(middleware, [raw])
    assert status == 400 and body["error"]["message"].startswith(expected) and body["error"]["param"] == "body"
    assert headers[b"x-request-id"]
    assert app.bodies == []


@pytest.mark.parametrize("headers", [[(b"content-type", b"multipart/form-data; boundary=x")], []])
def test_bodies_that_are_not_json_by_their_type_or_empty_go_to_vllm_unchanged(served, headers) -> None:
    middleware, app = served
    raw = b"--x\r\ncontent-disposition: form-data\r\n\r\n" if headers else b""
    assert _request(middleware, [raw], headers)[0] == 200
    assert app.bodies == [raw]


def test_a_failure_of_the_middleware_is_a_500_naming_the_request_id_which_the_log_names(served, monkeypatch,
                                                                                           caplog) -> None:
    middleware, app = served

    def broken(payload):
        raise KeyError("a bug")

    monkeypatch.setattr(middleware_module, "strip_client_plans", broken)
    with caplog.at_level(logging.ERROR, logger="inference_node.middleware"):
        status, body, headers = _request(middleware, [b'{"prompt": "x"}'],
                                      [(b"content-type", b"application/json"), (b"x-request-id", b"req-42")])
    assert status == 500 and "req-42" in body["error"]["message"] and headers[b"x-request-id"] == b"req-42"
    assert any("req-42" in record.getMessage() and record.exc_info for record in caplog.records)
    assert app.bodies == []
    _, _, headers = _request(middleware, [b"{"], [(b"content-type", b"application/json"), (b"x-request-id", b"a b")])
    assert headers[b"x-request-id"] != b"a b"  # not a plain id: the middleware names the request itself
