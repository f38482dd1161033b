"""OpenAI-API middleware: turns a request's `memory` field into the user's retrieved facts in the prompt.

A pure ASGI middleware (vLLM `--middleware inference_node.middleware.MemoryMiddleware`) in front of every route:
- Every POST with a JSON body, on any route vLLM serves or may add, loses the client's own `kv_transfer_params`
  and reserved cache salts before vLLM sees it (`plan.strip_client_plans`; counted in
  `inferscale_node_client_plans_refused_total`): load plans come from this middleware only, signed.
- On POST /v1/chat/completions and /v1/completions, `memory` is removed and read (inference_node.memory_request),
  the user's facts retrieved (inference_node.retrieval) and placed in the prompt (inference_node.placement); the
  rewritten body is replayed to vLLM once and `receive` delegated. Responses get an `x-inferscale-memory` header
  with a JSON summary; if the memory service fails the call (other than by refusing a value the request gave: a 400
  naming the request's field) the request is answered without memory, and the header says so.
- The middleware answers itself, with a 4xx whose message starts with the field, whatever those modules refuse
  (RequestRefused), a body that is not JSON though it says it is, nested too deeply for the parser, or larger than
  MAX_BODY_BYTES (413); and, on any other route, a `memory` field. Any failure of its own is logged with the request
  id (`x-request-id`, the client's or a new one) and answered 500 naming it; never does vLLM see such a request.
- Once the server is told to stop (SIGTERM, SIGINT), `GET /health` and every new POST are answered 503
  (`drain.StopWatch`; counted in `inferscale_node_stopping_refused_total`) while vLLM finishes the requests in flight.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter

from inference_node.drain import StopWatch
from inference_node.memory_request import (
    MEMORY_PATHS,
    MemoryRequest,
    MemoryRequestError,
    RequestRefused,
    leading_field,
    parse_memory,
    question_of,
)
from inference_node.placement import MemoryPlacement, Placed
from inference_node.plan import LOAD_OUTCOME_KEY, strip_client_plans
from inference_node.retrieval import Dropped, MemoryRetriever
from inference_node.settings import NodeSettings

SUMMARY_HEADER = b"x-inferscale-memory"
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# The largest request body the middleware reads; a larger one is answered 413 before it is buffered.
MAX_BODY_BYTES = 64 << 20
_ERROR_TYPES = {413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
LOGGER = logging.getLogger(__name__)

REQUESTS = Counter("inferscale_node_memory_requests", "requests with a memory field, by mode", ["mode"])
STOPPING_REFUSED = Counter("inferscale_node_stopping_refused", "requests answered 503 because the node is stopping")
CLIENT_PLANS_REFUSED = Counter("inferscale_node_client_plans_refused",
                               "client-sent kv_transfer_params and reserved cache salts removed from request bodies")

Scope = dict[str, Any]
Message = dict[str, Any]


def _single_header(scope: Scope, name: str) -> str | None:
    """The header's value when the request carries it exactly once, else None (absent or repeated: a repeated
    copy may be the client's, left in place by a gateway that appended its own)."""
    wanted = name.lower().encode()
    values = [value.decode("latin-1") for key, value in scope.get("headers", []) if key.lower() == wanted]
    return values[0] if len(values) == 1 else None


class MemoryMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.settings = NodeSettings.from_env()
        self._retriever = MemoryRetriever(self.settings)
        self._placement = MemoryPlacement(self.settings)
        self._stop_watch = StopWatch()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":  # the server is up, its own stop-signal handlers registered
            self._stop_watch.install()
        elif scope["type"] == "http" and self._stop_watch.refuses(scope.get("method"), scope.get("path")):
            await _refuse_stopping(send, _request_id(scope))
            return
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        try:
            forward = await self._admit(scope, receive, send)
        except RequestRefused as refused:
            message = str(refused)
            await _send_error(send, refused.status, message, leading_field(message), request_id)
            return
        except RecursionError:  # the body's nesting, wherever it was met (parsing, re-serializing)
            await _send_error(send, 400, "body: nested too deeply to parse", "body", request_id)
            return
        except Exception:  # the middleware's own failure, not the client's: logged with the request id
            LOGGER.exception("memory middleware failed: request %s, POST %s", request_id, scope.get("path"))
            await _send_error(send, 500, f"the memory middleware failed on this request (request id {request_id})",
                              None, request_id)
            return
        if self._stop_watch.stopping:  # told to stop while its memory was being fetched: vLLM may be gone already
            await _refuse_stopping(send, request_id)
            return
        await self.app(*forward)

    async def _admit(self, scope: Scope, receive: Callable, send: Callable) -> tuple[Scope, Callable, Callable]:
        """What vLLM gets for this request (scope, receive, send); RequestRefused where the middleware answers."""
        body = await _read_body(receive)
        try:
            payload = json.loads(body)
        except ValueError as error:
            if body and _declares_json(scope):
                raise RequestRefused(f"body: not valid JSON ({str(error)[:200]})") from None
            # Not JSON (a form, or no body at all): vLLM reads no load plan from it.
            return scope, _replay(body, receive), send
        refused = strip_client_plans(payload)
        if refused:
            CLIENT_PLANS_REFUSED.inc(refused)
        path = scope.get("path")
        if not isinstance(payload, dict) or "memory" not in payload:
            if refused:
                return *_rewritten(scope, json.dumps(payload).encode(), receive), send
            return scope, _replay(body, receive), send
        if path not in MEMORY_PATHS:
            raise MemoryRequestError(f"memory: supported on {' and '.join(sorted(MEMORY_PATHS))} only, not {path}")
        memory = parse_memory(payload.pop("memory"), self.settings)
        if self.settings.user_header and _single_header(scope, self.settings.user_header) != memory.user_id:
            # The gateway in front of the node authenticated the caller and named its user in this header: a
            # client cannot reach any other user's memory, whatever its body says.
            raise RequestRefused(f"memory.user_id: must be the user named by the {self.settings.user_header} "
                                 "header, sent exactly once", status=403)
        if self.settings.user_token_header and memory.mode != "off":
            token = _single_header(scope, self.settings.user_token_header)
            if not token:
                raise RequestRefused(f"{self.settings.user_token_header}: the user token your gateway mints, sent "
                                     "exactly once, is required with memory", status=401)
            memory = dataclasses.replace(memory, user_token=token)
        question = question_of(payload, path, memory)
        REQUESTS.labels(mode=memory.mode).inc()
        summary: dict[str, Any] = {"mode": memory.mode}
        placed = await self._add_memory(payload, path, memory, question, summary) if memory.mode != "off" else None
        rewritten = _json_with(payload, placed.members if placed else {})
        # A non-streamed answer with a load plan holds what became of its memory (the connector's request_finished,
        # in kv_transfer_params): the summary waits for its body to say so.
        awaits_outcome = placed is not None and placed.signed_plan and not payload.get("stream")
        held: list[Message] = []

        async def send_with_summary(message: Message) -> None:
            if message["type"] == "http.response.start":
                if awaits_outcome:
                    held.append(message)
                    return
                message = _with_summary(message, summary)
            elif held and message["type"] == "http.response.body":
                outcome = None if message.get("more_body") else load_outcome(message.get("body", b""))
                await send(_with_summary(held.pop(), {**summary, **(outcome or {})}))
            await send(message)

        return *_rewritten(scope, rewritten, receive), send_with_summary

    async def _add_memory(self, payload: dict, path: str, memory: MemoryRequest, query: str,
                          summary: dict[str, Any]) -> Placed | None:
        """Puts the user's memory in the request (MemoryPlacement.place), or nothing where the memory service failed
        the call. Placing runs on the event loop: it holds the GIL throughout but in the tokenizer, and a thread's
        hand-off cost more than it (benchmarks/RESULTS.md, "A memory request's own cost")."""
        self._placement.prepare()  # before the memory service is asked: a node without its tokenizer asks nothing
        retrieved = await self._retriever.retrieve(memory, query, path)
        if isinstance(retrieved, Dropped):
            summary.update(retrieved.summary_fields())
            return None
        return self._placement.place(payload, path, memory, retrieved, summary)


def _with_summary(start: Message, summary: dict[str, Any]) -> Message:
    summary_bytes = json.dumps(summary, separators=(",", ":")).encode()
    return {**start, "headers": [*start.get("headers", []), (SUMMARY_HEADER, summary_bytes)]}


def load_outcome(body: bytes) -> dict[str, Any] | None:
    """The summary's fields for what the connector says became of the memory (`load`: resident, waited, partial,
    prefix_cache or prefilled; `tokens_loaded`), read from vLLM's answer's kv_transfer_params (its last member: only
    that object is decoded, not the answer); None if it says nothing."""
    at = body.rfind(b'"kv_transfer_params"')
    if at < 0 or LOAD_OUTCOME_KEY.encode() not in body[at:]:
        return None
    try:
        text = body[at:].decode()
        value = text[text.index(":") + 1 :].lstrip()
        params, _ = json.JSONDecoder().raw_decode(value)
        said = params.get(LOAD_OUTCOME_KEY)
    except (ValueError, AttributeError):
        return None
    if not (isinstance(said, dict) and isinstance(said.get("outcome"), str)
            and isinstance(said.get("tokens_loaded"), int)):
        return None
    return {"load": said["outcome"], "tokens_loaded": said["tokens_loaded"]}


async def _read_body(receive: Callable) -> bytes:
    """The request's body; RequestRefused (413) past MAX_BODY_BYTES."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestRefused(f"body: larger than {MAX_BODY_BYTES >> 20} MiB", status=413)
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _json_with(payload: dict, members: dict[str, bytes]) -> bytes:
    """`payload` as JSON, with `members` (already JSON, names not in `payload`) added."""
    head = json.dumps(payload).encode()
    if not members:
        return head
    added = b", ".join(json.dumps(name).encode() + b": " + value for name, value in members.items())
    return head[:-1] + (b", " if payload else b"") + added + b"}"


def _declares_json(scope: Scope) -> bool:
    """Whether vLLM would read the body as JSON: a JSON content type, or none."""
    content_type = (_single_header(scope, "content-type") or "").split(";")[0].strip().lower()
    return not content_type or content_type == "application/json" or content_type.endswith("+json")


def _request_id(scope: Scope) -> str:
    """The client's x-request-id when it sends one plain id, else a new one: it names the request in logs and in
    the middleware's error answers."""
    sent = _single_header(scope, REQUEST_ID_HEADER)
    return sent if sent and _REQUEST_ID.fullmatch(sent) else uuid.uuid4().hex


def _rewritten(scope: Scope, body: bytes, receive: Callable) -> tuple[Scope, Callable]:
    """The scope (with a content-length that fits) and receive for replaying a rewritten body."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    return {**scope, "headers": headers}, _replay(body, receive)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A receive that yields the (rewritten) body once, then delegates (disconnects and so on)."""
    delivered = False

    async def replay_receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay_receive


async def _refuse_stopping(send: Callable, request_id: str) -> None:
    STOPPING_REFUSED.inc()
    await _send_error(send, 503, "the node is stopping: send the request to another node", None, request_id,
                      close=True)


async def _send_error(send: Callable, status: int, message: str, param: str | None, request_id: str, *,
                      close: bool = False) -> None:
    """An OpenAI-style error answer (`param`: the request's top-level field it is about) naming the request;
    `close` ends the client's connection after it."""
    body = json.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError"),
                                 "param": param, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (REQUEST_ID_HEADER.encode(), request_id.encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"connection", b"close")] if close else headers})
    await send({"type": "http.response.body", "body": body})
