"""OpenAI-API middleware: turns a request's `memory` field into the user's retrieved facts in the prompt.

A pure ASGI middleware (vLLM `--middleware inference_node.middleware.MemoryMiddleware`) in front of every route:
- Every POST with a JSON body, on any route vLLM serves or may add, loses the client's own `kv_transfer_params`
  and reserved cache salts before vLLM sees it (`plan.strip_client_plans`; counted in
  `inferscale_node_client_plans_refused_total`): load plans come from this middleware only, signed.
- On POST /v1/chat/completions and /v1/completions, `memory` is removed, RetrieveAndStage called, the facts
  written into the prompt (one per line, best last, each in its neutral form: never a control token) and, in kv
  mode, the signed load plan (`kv_transfer_params`) and signed `cache_salt` added; the rewritten body is replayed
  to vLLM once and `receive` delegated. Completions in a memory mode get their prompt as token ids (the layout's
  tokenization, memory_prompt.MemoryTokens; as text without added special tokens for a tokenizer whose pieces do
  not concatenate: the header carries the BOS). Responses get an `x-inferscale-memory` header with a JSON summary.
  If the memory service cannot be reached the request is answered without memory, and the header says so.
- A request whose own value the memory service refuses (INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming `user_id`,
  `top_k`, `retrieval` or `query`) is answered 400 naming the request's field, with the service's message.
- The middleware answers itself, with a 4xx whose message starts with the field: `memory` on any other route, a
  `memory` field with an unknown key or a wrong value (`user_id` by the memory service's id rule), no question
  (blank after trimming) in kv or text mode, a body that is not JSON though it says it is, nested too deeply for
  the parser, or larger than MAX_BODY_BYTES (413). Any failure of its own is logged with the request id
  (`x-request-id`, the client's or a new one) and answered 500 naming it; never does vLLM see such a request.
- Once the server is told to stop (SIGTERM, SIGINT), `GET /health` and every new POST are answered 503
  (`drain.StopWatch`; counted in `inferscale_node_stopping_refused_total`) while vLLM finishes the requests in flight.

    "memory": {"user_id": "...", "top_k": 20, "mode": "kv" | "text" | "off",
               "order": "ranked" | "created", "recompute_tail_facts": m, "kv_crossover_tokens": n,
               "retrieval": "vector" | "keyword" | "hybrid", "max_tokens": t}

order "ranked" (default) puts the best fact last, nearest the question; "created" keeps a user's facts in the order
they were stored, so that text prompts of consecutive requests share a prefix vLLM's prefix cache can reuse.
recompute_tail_facts (default: the node's --recompute-tail-facts) prefills the last m facts of kv mode as text.
retrieval (default: the memory service's --retrieval-mode) says how the facts are ranked. max_tokens (default 0: no
cap) caps the memory's tokens: the best-ranked facts whose lines (as the prompt tokenizes them) fit in t tokens
together are kept, the rest left out, in kv and text mode alike.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
from prometheus_client import Counter, Histogram

from inference_node.drain import StopWatch
from inference_node.memory_prompt import FACT_ORDERS, FactLines, MemoryTokens, plan_memory, system_content
from inference_node.plan import PlanSigner, plan_secret_from_env, strip_client_plans
from inference_node.query_embedding import LocalQueryEmbedder
from inference_node.settings import NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import NODE, bearer_metadata, memory_service_aio_channel
from inferscale_kv.ids import ID_RULE, is_valid_id
from inferscale_kv.layout import memory_header_ids, memory_header_text
from inferscale_kv.stored_text import StoredTextGuard

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MEMORY_PATHS = {"/v1/chat/completions", "/v1/completions"}
MODES = ("kv", "text", "off")
MEMORY_FIELDS = ("user_id", "top_k", "mode", "order", "recompute_tail_facts", "kv_crossover_tokens", "retrieval",
                 "max_tokens")
RETRIEVAL_MODES = {"vector": pb.RETRIEVAL_MODE_VECTOR, "keyword": pb.RETRIEVAL_MODE_KEYWORD,
                   "hybrid": pb.RETRIEVAL_MODE_HYBRID}
MAX_MEMORY_TOKENS = 1 << 20  # the largest memory.max_tokens (and kv_crossover_tokens) a request may give
SUMMARY_HEADER = b"x-inferscale-memory"
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# The memory service's default --max-query-chars: a longer question is searched by its beginning.
MAX_QUERY_CHARS = 2000
# The largest request body the middleware reads; a larger one is answered 413 before it is buffered.
MAX_BODY_BYTES = 64 << 20
_ERROR_TYPES = {413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
LOGGER = logging.getLogger(__name__)

REQUESTS = Counter("inferscale_node_memory_requests", "requests with a memory field, by mode", ["mode"])
STOPPING_REFUSED = Counter("inferscale_node_stopping_refused", "requests answered 503 because the node is stopping")
DROP_DEADLINE, DROP_UNAVAILABLE, DROP_ERROR = "deadline", "unavailable", "error"
DROP_REASONS = (DROP_DEADLINE, DROP_UNAVAILABLE, DROP_ERROR)
MEMORY_DROPPED = Counter("inferscale_node_memory_dropped", "memory requests answered without their memory because "
                         "RetrieveAndStage failed, by reason (deadline: past --retrieve-timeout-s; unavailable: no "
                         "replica answered; error: any other status)", ["reason"])
for _reason in DROP_REASONS:  # each reason's series exists from the start, at 0 in a healthy run
    MEMORY_DROPPED.labels(reason=_reason)
_DROP_REASON_OF_CODE = {grpc.StatusCode.DEADLINE_EXCEEDED: DROP_DEADLINE, grpc.StatusCode.UNAVAILABLE: DROP_UNAVAILABLE}
# The memory service refusing what a request asked: a RetrieveAndStage field the request's own values fill (the
# service's message starts with it) -> the request's field. Refusing any other field (the node's profile, node id or
# query embedding) is the node's configuration disagreeing with the service: the memory is dropped (reason error).
_REFUSAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
_REQUEST_FIELD_OF = {"user_id": "memory.user_id", "top_k": "memory.top_k", "retrieval": "memory.retrieval"}
FACTS_PLACED = Counter("inferscale_node_facts", "facts placed in prompts, by how", ["how"])
CLIENT_PLANS_REFUSED = Counter("inferscale_node_client_plans_refused",
                               "client-sent kv_transfer_params and reserved cache salts removed from request bodies")
STAGE_SECONDS = Histogram("inferscale_node_stage_seconds", "RetrieveAndStage latency seen by the node",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

Scope = dict[str, Any]
Message = dict[str, Any]


class RequestRefused(ValueError):
    """A request the middleware answers itself, with HTTP `status` (400 unless said); the message starts with the
    field it is about."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class MemoryRequestError(RequestRefused):
    """The `memory` field is malformed (HTTP 400)."""


@dataclass(frozen=True)
class MemoryRequest:
    """A request's `memory` field, validated."""

    user_id: str
    top_k: int
    mode: str  # kv | text | off
    order: str  # FACT_ORDERS: ranked (best last) | created (stable per user)
    recompute_tail_facts: int  # kv mode: facts nearest the question prefilled as text
    kv_crossover_tokens: int  # kv mode: a shorter injectable memory is served as text
    retrieval: str = ""  # RETRIEVAL_MODES, or "": the memory service's default
    max_tokens: int = 0  # the most tokens the facts' lines may take together; 0: no cap


def _int_field(memory: dict, name: str, default: int, low: int, high: int) -> int:
    value = memory.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MemoryRequestError(f"memory.{name}: must be an integer in [{low}, {high}]")
    return value


def parse_memory(memory: Any, settings: NodeSettings) -> MemoryRequest:
    """The validated `memory` field; MemoryRequestError naming the first field that is unknown or wrong."""
    if not isinstance(memory, dict):
        raise MemoryRequestError("memory: must be an object")
    unknown = sorted(set(memory) - set(MEMORY_FIELDS))
    if unknown:
        raise MemoryRequestError(f"memory.{unknown[0][:64]}: unknown field (memory takes {', '.join(MEMORY_FIELDS)})")
    user_id = memory.get("user_id")
    if not isinstance(user_id, str) or not is_valid_id(user_id):
        shown = f"{user_id[:40]!r} is not a valid id" if isinstance(user_id, str) else "must be a string"
        raise MemoryRequestError(f"memory.user_id: {shown} ({ID_RULE})")
    mode = memory.get("mode", "kv")
    if not isinstance(mode, str) or mode not in MODES:
        raise MemoryRequestError(f"memory.mode: must be one of {', '.join(MODES)}")
    order = memory.get("order", "ranked")
    if not isinstance(order, str) or order not in FACT_ORDERS:
        raise MemoryRequestError(f"memory.order: must be one of {', '.join(FACT_ORDERS)}")
    top_k = _int_field(memory, "top_k", settings.default_top_k, 1, settings.max_top_k)
    tail = _int_field(memory, "recompute_tail_facts", settings.recompute_tail_facts, 0, settings.max_top_k)
    crossover = _int_field(memory, "kv_crossover_tokens", settings.kv_crossover_tokens, 0, MAX_MEMORY_TOKENS)
    retrieval = memory.get("retrieval", "")
    if retrieval != "" and (not isinstance(retrieval, str) or retrieval not in RETRIEVAL_MODES):
        raise MemoryRequestError(f"memory.retrieval: must be one of {', '.join(RETRIEVAL_MODES)}")
    max_tokens = _int_field(memory, "max_tokens", 0, 0, MAX_MEMORY_TOKENS)
    return MemoryRequest(user_id, top_k, mode, order, tail, crossover, retrieval, max_tokens)


def _single_header(scope: Scope, name: str) -> str | None:
    """The header's value when the request carries it exactly once, else None (absent or repeated: a repeated
    copy may be the client's, left in place by a gateway that appended its own)."""
    wanted = name.lower().encode()
    values = [value.decode("latin-1") for key, value in scope.get("headers", []) if key.lower() == wanted]
    return values[0] if len(values) == 1 else None


def _text_of(content: Any, field: str) -> str:
    """The text of a message's content (a string, or text parts); RequestRefused naming `field` for any other."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict)]
        if all(isinstance(text, str) for text in texts):
            return " ".join(texts)
    raise RequestRefused(f"{field}: with memory, must be a string or a list of parts whose text is a string")


def question_of(payload: dict, path: str, memory: MemoryRequest) -> str:
    """The question the memory is retrieved for (the last user message's text, or the completion prompt), as the
    memory service's query: without NUL characters, trimmed, at most MAX_QUERY_CHARS. RequestRefused naming the
    field where the request has no question in a retrieving mode, or a prompt the memory cannot be put before."""
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise RequestRefused("messages: with memory, must be a list of messages")
        users = [index for index, message in enumerate(messages)
                 if isinstance(message, dict) and message.get("role") == "user"]
        field = f"messages[{users[-1]}].content" if users else "messages"
        text = _text_of(messages[users[-1]].get("content"), field) if users else ""
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
            # What the memory's system message takes: tokenized with it, so Unicode throughout.
            _unicode(_text_of(messages[0].get("content"), "messages[0].content"), "messages[0].content")
    else:
        field, text = "prompt", payload.get("prompt", "")
        if not isinstance(text, str):
            raise RequestRefused("prompt: with memory, must be one string (not token ids or a list)")
    query = _unicode(text, field).replace("\x00", "").strip()[:MAX_QUERY_CHARS]
    if memory.mode != "off" and not query:
        raise RequestRefused(f"{field}: with memory, the question must be text that is not empty or whitespace")
    return query


def _refused_by_service(error: grpc.aio.AioRpcError, path: str) -> RequestRefused | None:
    """The request refused (400, named by its own field, with the service's message) when the memory service
    refused a value the request gave (INVALID_ARGUMENT or RESOURCE_EXHAUSTED: e.g. a top_k past its --max-top-k, a
    query past its --max-query-chars); None for any other failure."""
    if error.code() not in _REFUSAL_CODES:
        return None
    details = error.details() or ""
    service_field = re.split(r"[.\[:]", details, maxsplit=1)[0]
    question_field = "prompt" if path == "/v1/completions" else "messages"
    field = question_field if service_field == "query" else _REQUEST_FIELD_OF.get(service_field)
    if field is None:
        return None
    return RequestRefused(f"{field}: the memory service refused it ({error.code().name}: {details[:500]})")


def _unicode(text: str, field: str) -> str:
    """`text`, whole, if it is Unicode text: the node tokenizes all of it (a completions prompt), not only the
    memory service's query."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise RequestRefused(f"{field}: must be Unicode text (it holds a lone surrogate escape)") from None
    return text


class MemoryMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.settings = NodeSettings.from_env()
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._header_ids: list[int] = []
        self._header_text = ""
        self._fact_lines = FactLines(StoredTextGuard(()))
        self._memory_tokens: MemoryTokens | None = None
        self._stub: memory_pb2_grpc.MemoryServiceStub | None = None
        self._call_metadata: tuple[tuple[str, str], ...] = ()
        self._profile = pb.KvProfile(**self.settings.profile)
        self._signer = PlanSigner(plan_secret_from_env())
        self._query_embedder = (LocalQueryEmbedder(self.settings.embedding_model)
                                if self.settings.embed_queries_locally else None)
        self._stop_watch = StopWatch()

    def _prepare(self) -> memory_pb2_grpc.MemoryServiceStub:
        """Loads the tokenizer and opens the memory service's channel on first use; the stub."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.settings.model_dir)
            self._header_ids = memory_header_ids(self._tokenizer)
            self._header_text = memory_header_text(self._tokenizer)
            self._fact_lines = FactLines(StoredTextGuard.for_tokenizer(self._tokenizer))
            self._memory_tokens = MemoryTokens(self._tokenizer)
        if self._stub is None:
            channel = memory_service_aio_channel(self.settings.memory_service, NODE)
            self._stub = memory_pb2_grpc.MemoryServiceStub(channel)
            self._call_metadata = bearer_metadata(NODE)
        return self._stub

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
            await _send_error(send, refused.status, message, re.split(r"[.\[:]", message, maxsplit=1)[0], request_id)
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
        question = question_of(payload, path, memory)
        REQUESTS.labels(mode=memory.mode).inc()
        summary: dict[str, Any] = {"mode": memory.mode}
        members = await self._add_memory(payload, path, memory, question, summary) if memory.mode != "off" else {}
        rewritten = _json_with(payload, members)
        summary_bytes = json.dumps(summary, separators=(",", ":")).encode()

        async def send_with_summary(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (SUMMARY_HEADER, summary_bytes)]}
            await send(message)

        return *_rewritten(scope, rewritten, receive), send_with_summary

    async def _add_memory(self, payload: dict, path: str, memory: MemoryRequest, query: str,
                          summary: dict[str, Any]) -> dict[str, bytes]:
        """Puts the user's memory in the request: in `payload`, or, for what holds every token id of the memory
        (the signed load plan, a token-id prompt), in the body members it returns, already JSON."""
        stub = self._prepare()
        started = time.perf_counter()
        request = pb.RetrieveAndStageRequest(user_id=memory.user_id, query=query, top_k=memory.top_k,
                                             profile=self._profile, node_id=self.settings.node_id,
                                             retrieval=RETRIEVAL_MODES.get(memory.retrieval,
                                                                           pb.RETRIEVAL_MODE_UNSPECIFIED))
        if self._query_embedder is not None and memory.retrieval != "keyword":  # keyword ranks the text alone
            vector, model_id = await self._query_embedder.embed(query)
            request.query_vector.extend(vector)
            request.embedding_model_id = model_id
        try:
            response = await stub.RetrieveAndStage(request, timeout=self.settings.retrieve_timeout_s,
                                                   metadata=self._call_metadata)
        except grpc.aio.AioRpcError as exc:
            refused = _refused_by_service(exc, path)
            if refused is not None:
                raise refused from None
            # The one case a memory request is answered without its memory: counted, and said in the header.
            reason = _DROP_REASON_OF_CODE.get(exc.code(), DROP_ERROR)
            MEMORY_DROPPED.labels(reason=reason).inc()
            summary.update(memory="dropped", reason=reason, error=f"memory service: {exc.code().name}", facts=0,
                           injectable_tokens=0)
            return {}
        stage_seconds = time.perf_counter() - started
        STAGE_SECONDS.observe(stage_seconds)
        members: dict[str, bytes] = {}
        facts = list(response.facts)
        if memory.max_tokens and self._memory_tokens is not None:
            facts = self._memory_tokens.within_budget(facts, memory.max_tokens)
            summary.update(max_tokens=memory.max_tokens, facts_retrieved=len(response.facts))
        plan = plan_memory(facts, self._header_ids, response.header_content_id,
                           self.settings.profile_id, memory.user_id, FACT_ORDERS[memory.order],
                           memory.recompute_tail_facts if memory.mode == "kv" else 0, lines=self._fact_lines)
        if path == "/v1/chat/completions":
            messages = payload.get("messages", [])
            client_system = ""
            if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
                client_system = _text_of(messages.pop(0).get("content"), "messages[0].content")
            payload["messages"] = [{"role": "system", "content": system_content(plan.block_text, client_system)},
                                   *messages]
        elif self._memory_tokens is not None and self._memory_tokens.concatenative:
            # As token ids: vLLM would tokenize the whole memory again on every request.
            prompt_ids = self._memory_tokens.prompt(plan.facts, payload.pop("prompt", None) or "")
            members["prompt"] = msgspec.json.encode(prompt_ids)
        else:
            payload["prompt"] = self._header_text + plan.block_text + (payload.get("prompt") or "")
            # The header text carries the template's BOS: a second one would shift every position.
            payload["add_special_tokens"] = False
        summary.update(facts=len(plan.facts), stage_ms=round(stage_seconds * 1000, 2), order=memory.order)
        if not response.header_content_id:
            summary.update(header_kv="missing")
        inject = memory.mode == "kv" and bool(response.header_content_id)
        if inject and plan.injectable_tokens < memory.kv_crossover_tokens:
            # Shorter than the crossover: prefilling it is faster than injecting it.
            inject = False
            summary.update(served_as="text", kv_crossover_tokens=memory.kv_crossover_tokens)
        if inject:
            signed = self._signer.sign(plan.plan)
            members["kv_transfer_params"] = signed.kv_transfer_params_json
            payload["cache_salt"] = signed.cache_salt
            summary.update(kv_facts=plan.kv_facts, injectable_tokens=plan.injectable_tokens)
            FACTS_PLACED.labels(how="kv").inc(plan.kv_facts)
            FACTS_PLACED.labels(how="text").inc(len(plan.facts) - plan.kv_facts)
        else:  # the memory is prefilled: reusable by this user's requests only
            payload["cache_salt"] = self._signer.user_salt(self.settings.profile_id, memory.user_id)
            FACTS_PLACED.labels(how="text").inc(len(plan.facts))
        if memory.mode == "kv" and not inject:
            summary.update(kv_facts=0, injectable_tokens=0)
        return members


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
