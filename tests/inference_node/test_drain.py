"""A stopping node takes no new work (inference_node/drain.py): the stop signal still reaches the server's own loop
handler (asyncio's or uvloop's, as vLLM registers it) and marks the node stopping; the middleware then answers
readiness and new POSTs 503 and lets the rest through. Through real vLLM nodes: test_fleet_routing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterator

import pytest
import uvloop

from inference_node.drain import STOP_SIGNALS, StopWatch
from inference_node.middleware import MemoryMiddleware
from inference_node.settings import SETTINGS_ENV, NodeSettings
from tests.inference_node.asgi import RecordingApp
from tests.inference_node.test_middleware_input import PROFILE, _request


@pytest.fixture
def restored_signal_handlers() -> Iterator[None]:
    saved = {stop_signal: signal.getsignal(stop_signal) for stop_signal in STOP_SIGNALS}
    yield
    for stop_signal, handler in saved.items():
        signal.signal(stop_signal, handler)


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize("stop_signal", STOP_SIGNALS, ids=lambda number: signal.Signals(number).name)
def test_a_stop_signal_reaches_the_loop_handler_and_marks_the_node_stopping(
        restored_signal_handlers, new_loop: Callable[[], asyncio.AbstractEventLoop], stop_signal: int) -> None:
    loop = new_loop()
    fired: list[int] = []
    try:
        loop.add_signal_handler(stop_signal, fired.append, stop_signal)  # what vLLM's server registers
        watch = StopWatch()
        watch.install()
        watch.install()  # idempotent: one chain, not two
        assert not watch.stopping

        async def signalled() -> None:
            os.kill(os.getpid(), stop_signal)
            for _ in range(200):
                if fired:
                    return
                await asyncio.sleep(0.01)

        loop.run_until_complete(signalled())
        assert fired == [stop_signal] and watch.stopping
    finally:
        loop.remove_signal_handler(stop_signal)
        loop.close()


def _call(middleware: MemoryMiddleware, method: str, path: str) -> int:
    status, body, headers = _request(middleware, [json.dumps({"prompt": "x"}).encode()], path=path, method=method)
    if status == 503:
        assert headers[b"connection"] == b"close"
        assert body["error"]["message"].startswith("the node is stopping")
    return status


def test_a_stopping_node_answers_readiness_and_new_work_503_and_lets_the_rest_through(
        monkeypatch, node_plan_secret, restored_signal_handlers) -> None:
    settings = NodeSettings(memory_service="127.0.0.1:1", node_id="n", model_dir="/nonexistent", profile=PROFILE)
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    app = RecordingApp()
    middleware = MemoryMiddleware(app)
    calls = [("POST", "/v1/completions"), ("POST", "/ping"), ("GET", "/health"), ("GET", "/ping"), ("GET", "/metrics")]
    assert [_call(middleware, *call) for call in calls] == [200] * len(calls)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # stands in for the server's handler
    middleware._stop_watch.install()  # as on the server's lifespan startup
    os.kill(os.getpid(), signal.SIGTERM)
    assert [_call(middleware, *call) for call in calls] == [503, 503, 503, 200, 200]
    assert len(app.bodies) == len(calls) + 2  # nothing more reached vLLM
