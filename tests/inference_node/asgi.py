"""The node's middleware driven as vLLM's server drives it, in the test process: an app standing in for vLLM that
keeps what reaches it, and one request at a time through the middleware."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
JSON_HEADERS = [(b"content-type", b"application/json")]


class RecordingApp:
    """Stands in for vLLM behind the middleware: keeps each body it is handed (`bodies`) and answers 200 `answer`
    (`{}` unless set)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.answer = b"{}"

    def json(self, index: int = -1) -> Any:
        """The `index`th body it was handed, parsed."""
        return json.loads(self.bodies[index])

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        self.bodies.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": self.answer})


@dataclass(frozen=True)
class AsgiAnswer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> dict:
        """The body parsed, or {} for one that is not a JSON object."""
        return json.loads(self.body) if self.body.startswith(b"{") else {}


def asgi_request(app: ASGIApp, chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None,
                 path: str = "/v1/completions", method: str = "POST",
                 loop: asyncio.AbstractEventLoop | None = None) -> AsgiAnswer:
    """One request to `app` whose body arrives in `chunks` (JSON headers unless `headers` says), on `loop` (one that
    outlives the call, for a middleware whose channel to the memory service lives on it) or a loop of its own."""
    messages = [{"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
                for index, chunk in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": headers if headers is not None else JSON_HEADERS}
    if loop is None:
        asyncio.run(app(scope, receive, send))
    else:
        loop.run_until_complete(app(scope, receive, send))
    return AsgiAnswer(sent[0]["status"], dict(sent[0]["headers"]),
                      b"".join(message.get("body", b"") for message in sent[1:]))
