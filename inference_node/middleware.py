"""OpenAI-API middleware: turns a request's `memory` field into the user's retrieved facts in the prompt.

A pure ASGI middleware (vLLM `--middleware inference_node.middleware.MemoryMiddleware`) in front of every route:
- Every POST with a JSON body, on any route vLLM serves or may add, loses the client's own `kv_transfer_params`
  and reserved cache salts before vLLM sees it (`plan.strip_client_plans`; counted in
  `inferscale_node_client_plans_refused_total`): load plans come from this middleware only, signed.
- On POST /v1/chat/completions and /v1/completions, `memory` is removed, RetrieveAndStage called, the facts
  written into the prompt (one per line, best last) and, in kv mode, the signed load plan (`kv_transfer_params`)
  and signed `cache_salt` added; the rewritten body is replayed to vLLM once and `receive` delegated. Completions
  in a memory mode get their prompt as token ids (the layout's tokenization, memory_prompt.MemoryTokens; as text
  without added special tokens for a tokenizer whose pieces do not concatenate: the header carries the BOS). Responses
  get an `x-inferscale-memory` header with a JSON summary. If the memory service cannot be reached the request
  is answered without memory, and the header says so. `memory` on any other route is a 400.

    "memory": {"user_id": "...", "top_k": 20, "mode": "kv" | "text" | "off",
               "order": "ranked" | "created", "recompute_tail_facts": m}

order "ranked" (default) puts the best fact last, nearest the question; "created" keeps a user's facts in the order
they were stored, so that text prompts of consecutive requests share a prefix vLLM's prefix cache can reuse.
recompute_tail_facts (default: the node's --recompute-tail-facts) prefills the last m facts of kv mode as text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import msgspec
from prometheus_client import Counter, Histogram

from inference_node.memory_prompt import FACT_ORDERS, MemoryTokens, plan_memory, system_content
from inference_node.plan import PlanSigner, plan_secret_from_env, strip_client_plans
from inference_node.query_embedding import LocalQueryEmbedder
from inference_node.settings import NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import NODE, bearer_metadata, memory_service_aio_channel
from inferscale_kv.layout import memory_header_ids, memory_header_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MEMORY_PATHS = {"/v1/chat/completions", "/v1/completions"}
MODES = ("kv", "text", "off")
SUMMARY_HEADER = b"x-inferscale-memory"

REQUESTS = Counter("inferscale_node_memory_requests", "requests with a memory field, by mode", ["mode"])
DROP_DEADLINE, DROP_UNAVAILABLE, DROP_ERROR = "deadline", "unavailable", "error"
DROP_REASONS = (DROP_DEADLINE, DROP_UNAVAILABLE, DROP_ERROR)
MEMORY_DROPPED = Counter("inferscale_node_memory_dropped", "memory requests answered without their memory because "
                         "RetrieveAndStage failed, by reason (deadline: past --retrieve-timeout-s; unavailable: no "
                         "replica answered; error: any other status)", ["reason"])
for _reason in DROP_REASONS:  # each reason's series exists from the start, at 0 in a healthy run
    MEMORY_DROPPED.labels(reason=_reason)
_DROP_REASON_OF_CODE = {grpc.StatusCode.DEADLINE_EXCEEDED: DROP_DEADLINE, grpc.StatusCode.UNAVAILABLE: DROP_UNAVAILABLE}
FACTS_PLACED = Counter("inferscale_node_facts", "facts placed in prompts, by how", ["how"])
CLIENT_PLANS_REFUSED = Counter("inferscale_node_client_plans_refused",
                               "client-sent kv_transfer_params and reserved cache salts removed from request bodies")
STAGE_SECONDS = Histogram("inferscale_node_stage_seconds", "RetrieveAndStage latency seen by the node",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

Scope = dict[str, Any]
Message = dict[str, Any]


class MemoryRequestError(ValueError):
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


def _int_field(memory: dict, name: str, default: int, low: int, high: int) -> int:
    value = memory.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MemoryRequestError(f"memory.{name}: must be an integer in [{low}, {high}]")
    return value


def parse_memory(memory: Any, settings: NodeSettings) -> MemoryRequest:
    if not isinstance(memory, dict):
        raise MemoryRequestError("memory: must be an object")
    user_id = memory.get("user_id")
    if not isinstance(user_id, str) or not user_id:
        raise MemoryRequestError("memory.user_id: must be a non-empty string")
    mode = memory.get("mode", "kv")
    if mode not in MODES:
        raise MemoryRequestError(f"memory.mode: must be one of {', '.join(MODES)}")
    order = memory.get("order", "ranked")
    if not isinstance(order, str) or order not in FACT_ORDERS:
        raise MemoryRequestError(f"memory.order: must be one of {', '.join(FACT_ORDERS)}")
    top_k = _int_field(memory, "top_k", settings.default_top_k, 1, settings.max_top_k)
    tail = _int_field(memory, "recompute_tail_facts", settings.recompute_tail_facts, 0, settings.max_top_k)
    crossover = _int_field(memory, "kv_crossover_tokens", settings.kv_crossover_tokens, 0, 1 << 20)
    return MemoryRequest(user_id, top_k, mode, order, tail, crossover)


def _single_header(scope: Scope, name: str) -> str | None:
    """The header's value when the request carries it exactly once, else None (absent or repeated: a repeated
    copy may be the client's, left in place by a gateway that appended its own)."""
    wanted = name.lower().encode()
    values = [value.decode("latin-1") for key, value in scope.get("headers", []) if key.lower() == wanted]
    return values[0] if len(values) == 1 else None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def query_of(payload: dict, path: str) -> str:
    if path == "/v1/chat/completions":
        users = [m for m in payload.get("messages", []) if isinstance(m, dict) and m.get("role") == "user"]
        return _text_of(users[-1].get("content")) if users else ""
    prompt = payload.get("prompt")
    return prompt if isinstance(prompt, str) else ""


class MemoryMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.settings = NodeSettings.from_env()
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._header_ids: list[int] = []
        self._header_text = ""
        self._memory_tokens: MemoryTokens | None = None
        self._stub: memory_pb2_grpc.MemoryServiceStub | None = None
        self._call_metadata: tuple[tuple[str, str], ...] = ()
        self._profile = pb.KvProfile(**self.settings.profile)
        self._signer = PlanSigner(plan_secret_from_env())
        self._query_embedder = (LocalQueryEmbedder(self.settings.embedding_model)
                                if self.settings.embed_queries_locally else None)

    def _prepare(self) -> memory_pb2_grpc.MemoryServiceStub:
        """Loads the tokenizer and opens the memory service's channel on first use; the stub."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.settings.model_dir)
            self._header_ids = memory_header_ids(self._tokenizer)
            self._header_text = memory_header_text(self._tokenizer)
            self._memory_tokens = MemoryTokens(self._tokenizer)
        if self._stub is None:
            channel = memory_service_aio_channel(self.settings.memory_service, NODE)
            self._stub = memory_pb2_grpc.MemoryServiceStub(channel)
            self._call_metadata = bearer_metadata(NODE)
        return self._stub

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        try:
            payload = json.loads(body)
        except ValueError:  # not JSON (a form, say): vLLM reads no load plan from it
            await self.app(scope, _replay(body, receive), send)
            return
        refused = strip_client_plans(payload)
        if refused:
            CLIENT_PLANS_REFUSED.inc(refused)
        path = scope.get("path")
        if not isinstance(payload, dict) or "memory" not in payload:
            if refused:
                await self.app(*_rewritten(scope, json.dumps(payload).encode(), receive), send)
            else:
                await self.app(scope, _replay(body, receive), send)
            return
        if path not in MEMORY_PATHS:
            await _send_error(send, 400, f"memory: supported on {' and '.join(sorted(MEMORY_PATHS))} only, not {path}")
            return
        try:
            memory = parse_memory(payload.pop("memory"), self.settings)
            if path == "/v1/completions" and not isinstance(payload.get("prompt", ""), str):
                raise MemoryRequestError("prompt: with memory, must be one string (not token ids or a list)")
        except MemoryRequestError as exc:
            await _send_error(send, 400, str(exc))
            return
        if self.settings.user_header and _single_header(scope, self.settings.user_header) != memory.user_id:
            # The gateway in front of the node authenticated the caller and named its user in this header: a
            # client cannot reach any other user's memory, whatever its body says.
            await _send_error(send, 403, f"memory.user_id: must be the user named by the {self.settings.user_header}"
                                         " header, sent exactly once")
            return
        REQUESTS.labels(mode=memory.mode).inc()
        summary: dict[str, Any] = {"mode": memory.mode}
        members = await self._add_memory(payload, path, memory, summary) if memory.mode != "off" else {}
        summary_bytes = json.dumps(summary, separators=(",", ":")).encode()

        async def send_with_summary(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (SUMMARY_HEADER, summary_bytes)]}
            await send(message)

        await self.app(*_rewritten(scope, _json_with(payload, members), receive), send_with_summary)

    async def _add_memory(self, payload: dict, path: str, memory: MemoryRequest,
                          summary: dict[str, Any]) -> dict[str, bytes]:
        """Puts the user's memory in the request: in `payload`, or, for what holds every token id of the memory
        (the signed load plan, a token-id prompt), in the body members it returns, already JSON."""
        stub = self._prepare()
        query = (query_of(payload, path) or " ")[:2000]
        started = time.perf_counter()
        request = pb.RetrieveAndStageRequest(user_id=memory.user_id, query=query, top_k=memory.top_k,
                                             profile=self._profile, node_id=self.settings.node_id)
        if self._query_embedder is not None:
            vector, model_id = await self._query_embedder.embed(query)
            request.query_vector.extend(vector)
            request.embedding_model_id = model_id
        try:
            response = await stub.RetrieveAndStage(request, timeout=self.settings.retrieve_timeout_s,
                                                   metadata=self._call_metadata)
        except grpc.aio.AioRpcError as exc:
            # The one case a memory request is answered without its memory: counted, and said in the header.
            reason = _DROP_REASON_OF_CODE.get(exc.code(), DROP_ERROR)
            MEMORY_DROPPED.labels(reason=reason).inc()
            summary.update(memory="dropped", reason=reason, error=f"memory service: {exc.code().name}", facts=0,
                           injectable_tokens=0)
            return {}
        stage_seconds = time.perf_counter() - started
        STAGE_SECONDS.observe(stage_seconds)
        members: dict[str, bytes] = {}
        plan = plan_memory(list(response.facts), self._header_ids, response.header_content_id,
                           self.settings.profile_id, memory.user_id, FACT_ORDERS[memory.order],
                           memory.recompute_tail_facts if memory.mode == "kv" else 0)
        if path == "/v1/chat/completions":
            messages = payload.get("messages", [])
            client_system = ""
            if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
                client_system = _text_of(messages.pop(0).get("content"))
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
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
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


async def _send_error(send: Callable, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "memory",
                                 "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
