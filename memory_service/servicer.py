"""The inferscale.v1.MemoryService gRPC servicer: it only translates. Each handler validates its whole request
(memory_service.validation) before anything happens, calls one domain operation (memory_service.operations) and maps
its result to the response; the `rpc` wrapper (memory_service.rpc) does the rest."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Executor

import grpc
import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.kv_key import KvKey
from inferscale_kv.limits import MAX_RETRIEVE_BATCH
from memory_service.access import CALLER, AccessControl
from memory_service.blocking import run_blocking
from memory_service.builder import ServiceBuilder
from memory_service.config import Limits
from memory_service.coordination.work_queue import Job
from memory_service.coordination.workers import WorkerDevice
from memory_service.errors import InvalidArgument, MemoryServiceError, status_code_for
from memory_service.kv_pipeline import LeaseRequest
from memory_service.metrics import ServiceMetrics
from memory_service.models import Announcer, IngestOutcome, Query, RetrievalMode, StoredFact
from memory_service.operations import MemoryOperations, Retrieval, RetrievalRequest, ServiceStats
from memory_service.rpc import rpc
from memory_service.validation import (
    decode_page_token,
    encode_page_token,
    resolve_page_size,
    resolve_top_k,
    validate_announced_profile,
    validate_fact_ids,
    validate_fact_kv,
    validate_facts,
    validate_header_kv,
    validate_id,
    validate_kv_refs,
    validate_non_negative,
    validate_query,
    validate_rate,
    validate_turns,
)

log = structlog.get_logger(__name__)

# The calls of one RetrieveAndStageBatch that run at once (the rest wait): a batch takes a bounded share of the read
# threads, as that many single calls would.
BATCH_CALLS_AT_ONCE = 16
_OUTCOME_TO_PB = {
    IngestOutcome.CREATED: pb.INGEST_OUTCOME_CREATED,
    IngestOutcome.UPDATED: pb.INGEST_OUTCOME_UPDATED,
    IngestOutcome.UNCHANGED: pb.INGEST_OUTCOME_UNCHANGED,
}
_RETRIEVAL_FROM_PB = {
    pb.RETRIEVAL_MODE_VECTOR: RetrievalMode.VECTOR,
    pb.RETRIEVAL_MODE_KEYWORD: RetrievalMode.KEYWORD,
    pb.RETRIEVAL_MODE_HYBRID: RetrievalMode.HYBRID,
}
# The role an AnnounceProfileRequest declares, as memory_service.access names roles ("": unspecified).
_ROLES = {pb.PROFILE_ROLE_WORKER: "worker", pb.PROFILE_ROLE_NODE: "node"}
# RPCs whose blocking calls run on threads of their own (memory_service.blocking): those that write, the workers' KV
# traffic (multi-MB blob writes) and the nodes' KV fetches (multi-MB blob reads), each kind never queued behind the
# request path's reads or each other's.
WRITE_METHODS = frozenset({"IngestTurns", "IngestFacts", "DeleteFacts", "DeleteUser", "AnnounceProfile"})
KV_WORK_METHODS = frozenset({"LeaseKvWork", "CompleteKvWork"})
KV_READ_METHODS = frozenset({"FetchKv"})


def fetch_kv_response_bytes(key: KvKey, blob: bytes) -> bytes:
    """One FetchKv message, serialized (a blob is megabytes: FetchKv builds and encodes it on its read thread, not on
    the event loop; memory_service.rpc sends bytes a handler wrote as they are). The small fields are serialized by
    protobuf and the blob field framed after them by hand (field order is free on the wire): one copy of the blob,
    where building a message and serializing it copies it twice."""
    fields = pb.FetchKvResponse(fact_id=key.fact_id, version=key.version, content_id=key.content_id)
    if not blob:
        return fields.SerializeToString()
    return b"".join((fields.SerializeToString(), _BLOB_TAG, _varint(len(blob)), blob))


_BLOB_TAG = bytes([pb.FetchKvResponse.BLOB_FIELD_NUMBER << 3 | 2])  # field 3, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _timestamp(micros: int) -> Timestamp:
    timestamp = Timestamp()
    timestamp.FromMicroseconds(micros)
    return timestamp


def _seconds_timestamp(seconds: float) -> Timestamp:
    return _timestamp(int(seconds * 1_000_000))


def _fact_message(fact: StoredFact) -> pb.Fact:
    message = pb.Fact(
        user_id=fact.user_id,
        fact_id=fact.fact_id,
        text=fact.text,
        source_turn_id=fact.source_turn_id,
        metadata=fact.metadata,
        version=fact.version,
        created_at=_timestamp(fact.created_at_us),
        updated_at=_timestamp(fact.updated_at_us),
    )
    if fact.timestamp_us:
        message.timestamp.CopyFrom(_timestamp(fact.timestamp_us))
    return message


def _retrieval_message(retrieval: Retrieval) -> pb.RetrieveAndStageResponse:
    facts = [
        pb.RetrievedFact(
            fact_id=r.fact.fact_id, version=r.fact.version, text=r.fact.text, score=r.score, rank=rank,
            token_ids=r.kv.token_ids if r.kv else [], kv_ready=r.kv is not None, kv_bytes=r.kv.nbytes if r.kv else 0,
            content_id=r.kv.key.content_id if r.kv else "", created_at=_timestamp(r.fact.created_at_us))
        for rank, r in enumerate(retrieval.facts, start=1)
    ]
    return pb.RetrieveAndStageResponse(facts=facts, header_content_id=retrieval.header_content_id)


def _stats_message(stats: ServiceStats) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        users=stats.counts.users,
        facts=stats.counts.facts,
        turns=stats.counts.turns,
        embedding_model=stats.embedding_model,
        embedding_dim=stats.embedding_dim,
        embedding_model_id=stats.embedding_model_id,
        profiles=[
            pb.ProfileKvStats(
                profile_id=p.profile_id, model=p.fields["model"], context_window=p.fields["context_window"],
                kv_dtype=p.fields["kv_dtype"], queued=p.counts.queued, leased=p.counts.leased, done=p.counts.done,
                failed=p.counts.failed, lag_seconds=p.counts.lag_seconds, kv_bytes=p.counts.kv_bytes)
            for p in stats.profiles
        ],
        tiers=[
            pb.KvTierStats(name=t.name, entries=t.stats.entries, bytes=t.stats.bytes, budget_bytes=t.budget_bytes,
                           hits=t.stats.hits, lookups=t.stats.lookups, evictions=t.stats.evictions)
            for t in stats.tiers
        ],
        workers=[
            pb.WorkerStats(worker_id=w.worker_id, profile_id=w.profile_id,
                           last_seen_seconds_ago=stats.taken_at - w.last_seen, facts_per_second=w.facts_per_second,
                           device=_device_message(w.device))
            for w in stats.workers
        ],
    )


def _worker_device(request: pb.LeaseKvWorkRequest) -> WorkerDevice | None:
    if not request.HasField("device"):
        return None
    device = request.device
    return WorkerDevice(device.name, device.memory_total_bytes, device.memory_used_bytes, device.utilization_percent)


def _device_message(device: WorkerDevice | None) -> pb.WorkerDevice:
    return pb.WorkerDevice(**dataclasses.asdict(device)) if device else pb.WorkerDevice()


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    """Serves the API once `builder` is ready; until then every call is UNAVAILABLE (memory_service.rpc)."""

    def __init__(self, builder: ServiceBuilder, access: AccessControl, metrics: ServiceMetrics, limits: Limits) -> None:
        self.access = access
        self.metrics = metrics
        self._builder = builder
        self._limits = limits

    @property
    def ready(self) -> bool:
        return self._builder.service is not None

    def executor_for(self, method: str) -> Executor | None:
        service = self._builder.service
        if service is None:
            return None
        if method in WRITE_METHODS:
            return service.executors.writes
        if method in KV_WORK_METHODS:
            return service.executors.kv_work
        if method in KV_READ_METHODS:
            return service.executors.kv_reads
        return None

    @property
    def _operations(self) -> MemoryOperations:
        service = self._builder.service
        assert service is not None, "called before the service was built (the rpc wrapper answers UNAVAILABLE)"
        return service.operations

    def _retrieval(self, request: pb.SearchFactsRequest | pb.RetrieveAndStageRequest) -> tuple[Query, RetrievalMode]:
        """The request's query and retrieval mode (unset: --retrieval-mode, or vector for a query that is a vector
        alone, as callers that embed their queries sent before the modes existed)."""
        service = self._builder.service
        assert service is not None, "called before the service was built (the rpc wrapper answers UNAVAILABLE)"
        if request.retrieval == pb.RETRIEVAL_MODE_UNSPECIFIED:
            vector_alone = bool(request.query_vector) and not request.query.strip()
            mode = RetrievalMode.VECTOR if vector_alone else RetrievalMode(self._builder.config.retrieval_mode)
        elif request.retrieval in _RETRIEVAL_FROM_PB:
            mode = _RETRIEVAL_FROM_PB[request.retrieval]
        else:
            raise InvalidArgument("retrieval", f"{request.retrieval} is not a RetrievalMode")
        query = validate_query(request.query, request.query_vector, request.embedding_model_id, self._limits,
                               service.embedder.model_id, service.embedder.dim, mode)
        return query, mode

    # ------------------------------------------------------------------ RPCs

    @rpc
    async def IngestTurns(self, request: pb.IngestTurnsRequest, context) -> pb.IngestTurnsResponse:
        user_id = validate_id(request.user_id, "user_id")
        turns = validate_turns(request.turns, self._limits)
        return pb.IngestTurnsResponse(turns_written=await self._operations.ingest_turns(user_id, turns))

    @rpc
    async def IngestFacts(self, request: pb.IngestFactsRequest, context) -> pb.IngestFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        facts = validate_facts(request.facts, self._limits)
        results = await self._operations.ingest_facts(user_id, facts, CALLER.get())
        return pb.IngestFactsResponse(facts=[
            pb.IngestedFact(fact_id=r.fact_id, version=r.version, outcome=_OUTCOME_TO_PB[r.outcome]) for r in results])

    @rpc
    async def SearchFacts(self, request: pb.SearchFactsRequest, context) -> pb.SearchFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        top_k = resolve_top_k(request.top_k, self._limits)
        query, mode = self._retrieval(request)
        results = await self._operations.search(user_id, query, top_k, mode)
        return pb.SearchFactsResponse(facts=[
            pb.ScoredFact(fact=_fact_message(r.fact), score=r.score, rank=rank)
            for rank, r in enumerate(results, start=1)])

    @rpc
    async def RetrieveAndStage(self, request: pb.RetrieveAndStageRequest, context) -> pb.RetrieveAndStageResponse:
        return await self._retrieve_and_stage(request)

    @rpc
    async def RetrieveAndStageBatch(self, request: pb.RetrieveAndStageBatchRequest,
                                    context) -> pb.RetrieveAndStageBatchResponse:
        if not 0 < len(request.calls) <= MAX_RETRIEVE_BATCH:
            raise InvalidArgument("calls", f"must hold 1 to {MAX_RETRIEVE_BATCH} calls, not {len(request.calls)}")
        running = asyncio.Semaphore(BATCH_CALLS_AT_ONCE)
        results = await asyncio.gather(*(self._retrieve_one(call, running) for call in request.calls))
        return pb.RetrieveAndStageBatchResponse(results=results)

    async def _retrieve_one(self, call: pb.RetrieveAndStageRequest,
                            running: asyncio.Semaphore) -> pb.RetrieveAndStageResult:
        """One call of a batch, authorized for this caller and answered as RetrieveAndStage alone (its own status,
        counted and, unless OK, logged with its user); a failure of the service's own is INTERNAL for this call
        alone."""
        structlog.contextvars.bind_contextvars(user_id=call.user_id[:128])  # this call's task only
        code, message, response = grpc.StatusCode.OK, "", None
        try:
            self.access.authorize(CALLER.get(), "RetrieveAndStage", call)
            async with running:
                response = await self._retrieve_and_stage(call)
        except MemoryServiceError as error:
            code, message = status_code_for(error), str(error)
        except Exception:
            log.exception("batched_call_failed")
            code, message = grpc.StatusCode.INTERNAL, "internal error (the batch's request id names it in the logs)"
        self.metrics.batched_calls.labels(code=code.name).inc()
        if code != grpc.StatusCode.OK:
            log.info("batched_call_refused", code=code.name, error=message[:500])
        return pb.RetrieveAndStageResult(code=code.value[0], message=message, response=response)

    async def _retrieve_and_stage(self, request: pb.RetrieveAndStageRequest) -> pb.RetrieveAndStageResponse:
        user_id = validate_id(request.user_id, "user_id")
        top_k = resolve_top_k(request.top_k, self._limits)
        profile = validate_announced_profile(request.profile)
        validate_id(request.node_id, "node_id")  # required of every node, though the service uses it for nothing
        query, mode = self._retrieval(request)
        retrieval = RetrievalRequest(user_id=user_id, top_k=top_k, profile=profile, query=query, mode=mode)
        return _retrieval_message(await self._operations.retrieve_and_stage(retrieval))

    @rpc
    async def ListFacts(self, request: pb.ListFactsRequest, context) -> pb.ListFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        page_size = resolve_page_size(request.page_size, self._limits)
        after = decode_page_token(request.page_token)
        facts, more = await self._operations.list_facts(user_id, after, page_size)
        return pb.ListFactsResponse(facts=[_fact_message(fact) for fact in facts],
                                    next_page_token=encode_page_token(facts[-1].fact_id) if more else "")

    @rpc
    async def DeleteFacts(self, request: pb.DeleteFactsRequest, context) -> pb.DeleteFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        fact_ids = validate_fact_ids(request.fact_ids, self._limits)
        deleted = set(await self._operations.delete_facts(user_id, fact_ids))
        return pb.DeleteFactsResponse(facts_deleted=len(deleted),
                                      not_found_fact_ids=[fact_id for fact_id in fact_ids if fact_id not in deleted])

    @rpc
    async def DeleteUser(self, request: pb.DeleteUserRequest, context) -> pb.DeleteUserResponse:
        user_id = validate_id(request.user_id, "user_id")
        facts, turns = await self._operations.delete_user(user_id)
        return pb.DeleteUserResponse(facts_deleted=facts, turns_deleted=turns)

    @rpc
    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        user_id = validate_id(request.user_id, "user_id") if request.user_id else ""
        return _stats_message(await self._operations.stats(user_id, CALLER.get()))

    @rpc
    async def AnnounceProfile(self, request: pb.AnnounceProfileRequest, context) -> pb.AnnounceProfileResponse:
        profile = validate_announced_profile(request.profile)
        announcer = Announcer(validate_id(request.announcer_id, "announcer_id"), _ROLES.get(request.role, ""))
        header_kv = validate_header_kv(request.header_kv, profile) if request.header_kv else None
        queued = await self._operations.announce_profile(profile, header_kv, announcer, CALLER.get())
        return pb.AnnounceProfileResponse(profile_id=profile.profile_id, facts_queued=queued)

    @rpc
    async def LeaseKvWork(self, request: pb.LeaseKvWorkRequest, context) -> pb.LeaseKvWorkResponse:
        lease_request = LeaseRequest(
            worker_id=validate_id(request.worker_id, "worker_id"),
            profile_id=validate_id(request.profile_id, "profile_id"),
            max_facts=validate_non_negative(request.max_facts, "max_facts"),
            lease_seconds=validate_non_negative(request.lease_seconds, "lease_seconds"),
            facts_per_second=validate_rate(request.facts_per_second, "facts_per_second"),
            device=_worker_device(request),
        )
        lease = await self._operations.lease_kv_work(lease_request, CALLER.get())
        response = pb.LeaseKvWorkResponse(lease_id=lease.lease_id, header_kv_wanted=lease.header_wanted)
        if not lease.facts:
            return response
        response.expires_at.CopyFrom(_seconds_timestamp(lease.expires_at))
        response.items.extend(
            pb.KvWorkItem(user_id=f.user_id, fact_id=f.fact_id, version=f.version, text=f.text,
                          source_turn_id=f.source_turn_id)
            for f in lease.facts
        )
        for user_id, turns in lease.turns_by_user.items():
            response.turns.append(pb.UserTurns(user_id=user_id, turns=[
                pb.Turn(turn_id=t.turn_id, seq=t.seq, session_id=t.session_id, speaker=t.speaker, text=t.text)
                for t in turns
            ]))
        return response

    @rpc
    async def CompleteKvWork(self, request: pb.CompleteKvWorkRequest, context) -> pb.CompleteKvWorkResponse:
        worker_id = validate_id(request.worker_id, "worker_id")
        profile_id = validate_id(request.profile_id, "profile_id")
        uploads = validate_fact_kv(request.results, profile_id)
        failures = [(Job(profile_id, validate_id(f.user_id, f"failures[{index}].user_id"),
                         validate_id(f.fact_id, f"failures[{index}].fact_id"), f.version), f.error.replace("\0", ""))
                    for index, f in enumerate(request.failures)]
        counts = await self._operations.complete_kv_work(profile_id, request.lease_id, uploads, failures, worker_id,
                                                         CALLER.get())
        return pb.CompleteKvWorkResponse(accepted=counts.accepted, duplicates=counts.duplicates, stale=counts.stale)

    @rpc
    async def FetchKv(self, request: pb.FetchKvRequest, context: grpc.aio.ServicerContext) -> None:
        profile_id = validate_id(request.profile_id, "profile_id")
        user_id = validate_id(request.user_id, "user_id")
        refs = validate_kv_refs(request.facts, self._limits)
        async for key, blob in self._operations.fetch_kv(
                profile_id, user_id, refs, request.header_content_id if request.include_header else None):
            await context.write(await run_blocking(fetch_kv_response_bytes, key, blob))
