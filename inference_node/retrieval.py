"""The node's RetrieveAndStage call for one memory request: built from the request's `memory` and question (the query
embedded on this node with --embed-queries-locally), under the --retrieve-timeout-s deadline, its latency observed.
On a kv request of a user not warmed up lately it asks for --warm-facts more facts than the request's top_k: those
come back apart (`Retrieved.warm_up`) for the connector to fetch into the host tier; the request's memory is its own
top_k alone.

Calls that arrive while RETRIEVE_BATCHES_IN_FLIGHT calls are under way go together in the next RetrieveAndStageBatch
(`RetrievalBatcher`): one RPC for the queries that arrived together, each answered with its own status as alone.

The memory service refusing a value the request gave (INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming `user_id`,
`top_k`, `retrieval` or `query`) is the client's to fix: a RequestRefused naming the request's own field, with the
service's message. Any other failure (unreachable, past the deadline, the node's own configuration refused) is the
one case a memory request is answered without its memory: Dropped, with its reason, counted.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from inference_node.memory_request import RETRIEVAL_MODES, MemoryRequest, RequestRefused, leading_field
from inference_node.query_embedding import LocalQueryEmbedder
from inference_node.settings import WARM_UP_EVERY_S, NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import NODE, bearer_metadata, memory_service_aio_channel
from inferscale_kv.limits import HYBRID_CANDIDATES, MAX_BATCH_FACTS, MAX_RETRIEVE_BATCH

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
# The service refusing the user token the request's gateway header carried (RetrieveAndStageRequest.user_token).
_USER_TOKEN_FIELD = "user_token"
RETRIEVE_BATCH_CALLS = Histogram("inferscale_node_retrieve_batch_calls", "RetrieveAndStage calls per RPC sent to the "
                                 "memory service (1: sent alone)", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
# Calls (batches) to the memory service a node keeps under way; a call that arrives while this many are waits for
# one to end and goes with the others waiting then, in one RetrieveAndStageBatch.
RETRIEVE_BATCHES_IN_FLIGHT = 4
_STATUS_OF_CODE = {code.value[0]: code for code in grpc.StatusCode}
STAGE_SECONDS = Histogram("inferscale_node_stage_seconds", "RetrieveAndStage latency seen by the node",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))


@dataclass(frozen=True)
class Retrieved:
    response: pb.RetrieveAndStageResponse  # the request's own top_k facts, best first
    seconds: float  # from building the call to its answer (a local query embedding included)
    warm_up: tuple[pb.RetrievedFact, ...] = ()  # the next best, for the node's host tier (--warm-facts)


class WarmUps:
    """Which users' warm-ups were asked lately: a user's is asked again after WARM_UP_EVERY_S (by then the node may
    have let the user's KV go), at most `capacity` users remembered (least recently warmed out)."""

    def __init__(self, capacity: int = 100_000, every_s: float = WARM_UP_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.every_s = every_s
        self._clock = clock
        self._asked: OrderedDict[str, float] = OrderedDict()

    def due(self, user_id: str) -> bool:
        """The user's warm-up was not asked within `every_s`."""
        asked = self._asked.get(user_id)
        return asked is None or self._clock() - asked >= self.every_s

    def asked(self, user_id: str) -> None:
        """The user's warm-up was asked (the memory service answered with it)."""
        self._asked[user_id] = self._clock()
        self._asked.move_to_end(user_id)
        while len(self._asked) > self.capacity:
            self._asked.popitem(last=False)


@dataclass(frozen=True)
class Dropped:
    """The memory service failed the call: the request is answered without its memory."""

    reason: str  # DROP_REASONS
    code: grpc.StatusCode

    def summary_fields(self) -> dict[str, Any]:
        """What the request's x-inferscale-memory says of it."""
        return {"memory": "dropped", "reason": self.reason, "error": f"memory service: {self.code.name}", "facts": 0,
                "injectable_tokens": 0}


class RetrievalBatcher:
    """The node's RetrieveAndStage calls, sent alone while fewer than `in_flight` are under way, else together: the
    calls waiting when one ends go in one RetrieveAndStageBatch (at most MAX_RETRIEVE_BATCH calls and
    MAX_BATCH_FACTS facts), each answered or failed (a grpc.aio.AioRpcError of its own status) as alone. Each call
    keeps its own deadline: one past it fails DEADLINE_EXCEEDED then, sent or not. A memory service without the
    batch method (UNIMPLEMENTED: an earlier release) gets single calls for SINGLE_CALLS_FOR_S, then batches are tried
    again. Use from one event loop."""

    SINGLE_CALLS_FOR_S = 60.0

    def __init__(self, stub: memory_pb2_grpc.MemoryServiceStub, metadata: tuple[tuple[str, str], ...],
                 timeout_s: float, in_flight: int = RETRIEVE_BATCHES_IN_FLIGHT) -> None:
        self._stub = stub
        self._metadata = metadata
        self._timeout_s = timeout_s
        self._in_flight = in_flight
        self._running: set[asyncio.Task[None]] = set()
        self._waiting: list[_Call] = []
        self._single_until = 0.0

    async def call(self, request: pb.RetrieveAndStageRequest) -> pb.RetrieveAndStageResponse:
        loop = asyncio.get_running_loop()
        waiting = _Call(request, loop.time() + self._timeout_s, loop.create_future())
        expiry = loop.call_at(waiting.deadline, waiting.expire)
        self._waiting.append(waiting)
        self._send_waiting()
        try:
            return await waiting.future
        finally:
            expiry.cancel()

    def _send_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiting = [waiting for waiting in self._waiting if not waiting.future.done()]
        while self._waiting and len(self._running) < self._in_flight:
            batch: list[_Call] = []
            facts = 0
            limit = 1 if loop.time() < self._single_until else MAX_RETRIEVE_BATCH
            for waiting in self._waiting[:limit]:
                facts += waiting.request.top_k
                if batch and facts > MAX_BATCH_FACTS:
                    break
                batch.append(waiting)
            del self._waiting[: len(batch)]
            task = loop.create_task(self._send(batch))
            self._running.add(task)
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._send_waiting()

    async def _send(self, batch: list[_Call]) -> None:
        loop = asyncio.get_running_loop()
        live = [waiting for waiting in batch if not waiting.future.done()]
        if not live:
            return
        # The latest deadline of the batch: each call fails at its own (its timer), answered or not.
        timeout = max(0.001, max(waiting.deadline for waiting in live) - loop.time())
        RETRIEVE_BATCH_CALLS.observe(len(live))
        try:
            if len(live) == 1:
                results: list[pb.RetrieveAndStageResponse | grpc.aio.AioRpcError] = [
                    await self._stub.RetrieveAndStage(live[0].request, timeout=timeout, metadata=self._metadata)]
            else:
                answer = await self._stub.RetrieveAndStageBatch(
                    pb.RetrieveAndStageBatchRequest(calls=[waiting.request for waiting in live]), timeout=timeout,
                    metadata=self._metadata)
                results = [_result(result) for result in answer.results]
                if len(results) != len(live):
                    raise _status(grpc.StatusCode.INTERNAL, f"{len(results)} results for {len(live)} calls")
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED and len(live) > 1:
                self._single_until = loop.time() + self.SINGLE_CALLS_FOR_S  # an earlier release: one call each
                self._waiting[:0] = live
                return
            results = [_status(error.code(), error.details() or "") for _ in live]
        except Exception as error:  # never leave a caller waiting
            for waiting in live:
                waiting.fail(error)
            return
        for waiting, result in zip(live, results, strict=True):
            if isinstance(result, grpc.aio.AioRpcError):
                waiting.fail(result)
            elif not waiting.future.done():
                waiting.future.set_result(result)


@dataclass
class _Call:
    """A call waiting for its answer: sent alone or in a batch."""

    request: pb.RetrieveAndStageRequest
    deadline: float  # the event loop's time
    future: asyncio.Future[pb.RetrieveAndStageResponse]

    def fail(self, error: BaseException) -> None:
        if not self.future.done():  # answered, past its deadline, or its request gone away
            self.future.set_exception(error)

    def expire(self) -> None:
        """Its deadline passed, answered or not."""
        if not self.future.done():
            self.fail(_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A call's failure, as the channel raises it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _result(result: pb.RetrieveAndStageResult) -> pb.RetrieveAndStageResponse | grpc.aio.AioRpcError:
    """A batch's result as the call alone would have ended: its response, or its status as an AioRpcError."""
    if result.code == grpc.StatusCode.OK.value[0]:
        return result.response
    return _status(_STATUS_OF_CODE.get(result.code, grpc.StatusCode.UNKNOWN), result.message)


class MemoryRetriever:
    """The node's side of RetrieveAndStage: its KV profile, its id and credential, and the channel to the memory
    service (opened on first use)."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self._profile = pb.KvProfile(**settings.profile)
        self._query_embedder = LocalQueryEmbedder(settings.embedding_model) if settings.embed_queries_locally else None
        self._batcher: RetrievalBatcher | None = None
        self._warm_ups = WarmUps()

    def _connected(self) -> RetrievalBatcher:
        if self._batcher is None:
            channel = memory_service_aio_channel(self.settings.memory_service, NODE)
            self._batcher = RetrievalBatcher(memory_pb2_grpc.MemoryServiceStub(channel), bearer_metadata(NODE),
                                             self.settings.retrieve_timeout_s)
        return self._batcher

    async def retrieve(self, memory: MemoryRequest, query: str, path: str) -> Retrieved | Dropped:
        """The user's facts for `query` (a dropped memory counted by its reason); RequestRefused where the memory
        service refused a value the request on `path` gave."""
        batcher = self._connected()
        started = time.perf_counter()
        warm_facts = self._warm_facts(memory)
        request = pb.RetrieveAndStageRequest(user_id=memory.user_id, query=query, top_k=memory.top_k + warm_facts,
                                             profile=self._profile, node_id=self.settings.node_id,
                                             user_token=memory.user_token,
                                             retrieval=RETRIEVAL_MODES.get(memory.retrieval,
                                                                           pb.RETRIEVAL_MODE_UNSPECIFIED))
        if self._query_embedder is not None and memory.retrieval != "keyword":  # keyword ranks the text alone
            vector, model_id = await self._query_embedder.embed(query)
            request.query_vector.extend(vector)
            request.embedding_model_id = model_id
        try:
            try:
                response = await batcher.call(request)
            except grpc.aio.AioRpcError as exc:
                if not (warm_facts and exc.code() in _REFUSAL_CODES and leading_field(exc.details() or "") == "top_k"):
                    raise
                # The service's --max-top-k is below the request's top_k and the warm-up: the request's own.
                request.top_k, warm_facts = memory.top_k, 0
                response = await batcher.call(request)
        except grpc.aio.AioRpcError as exc:
            refused = _refused_by_service(exc, path, self.settings.user_token_header)
            if refused is not None:
                raise refused from None
            dropped = Dropped(_DROP_REASON_OF_CODE.get(exc.code(), DROP_ERROR), exc.code())
            MEMORY_DROPPED.labels(reason=dropped.reason).inc()
            return dropped
        seconds = time.perf_counter() - started
        STAGE_SECONDS.observe(seconds)
        if warm_facts:
            self._warm_ups.asked(memory.user_id)
        warm_up = tuple(response.facts[memory.top_k:])
        del response.facts[memory.top_k:]
        return Retrieved(response, seconds, warm_up)

    def _warm_facts(self, memory: MemoryRequest) -> int:
        """How many facts to ask beyond the request's own for a warm-up: --warm-facts on a kv request of a user not
        warmed up lately, within HYBRID_CANDIDATES with the request's (the request's own facts then rank as they
        would alone); 0 otherwise."""
        if memory.mode != "kv" or not self.settings.warm_facts or not self._warm_ups.due(memory.user_id):
            return 0
        return max(0, min(self.settings.warm_facts, HYBRID_CANDIDATES - memory.top_k))


def _refused_by_service(error: grpc.aio.AioRpcError, path: str, user_token_header: str) -> RequestRefused | None:
    """The request refused (400, named by its own field, with the service's message) when the memory service
    refused a value the request gave (INVALID_ARGUMENT or RESOURCE_EXHAUSTED: e.g. a top_k past its --max-top-k, a
    query past its --max-query-chars), or 403 (named by `user_token_header`) when it refused the request's user
    token; None for any other failure."""
    details = error.details() or ""
    # Without --user-token-header the node sent none: the node's configuration, not the request, is at fault.
    if (user_token_header and error.code() == grpc.StatusCode.PERMISSION_DENIED
            and leading_field(details) == _USER_TOKEN_FIELD):
        return RequestRefused(f"{user_token_header}: the memory service refused the user token "
                              f"({details[:500]})", status=403)
    if error.code() not in _REFUSAL_CODES:
        return None
    service_field = leading_field(details)
    question_field = "prompt" if path == "/v1/completions" else "messages"
    field = question_field if service_field == "query" else _REQUEST_FIELD_OF.get(service_field)
    if field is None:
        return None
    return RequestRefused(f"{field}: the memory service refused it ({error.code().name}: {details[:500]})")
