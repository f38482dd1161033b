"""The inferscale.v1.MemoryService gRPC servicer: wire messages in, domain calls, wire messages out."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from memory_service.access import CALLER, AccessControl
from memory_service.blocking import blocking_calls_on, run_blocking
from memory_service.config import ServiceConfig
from memory_service.embedder import Embedder
from memory_service.errors import (
    InvalidArgument,
    LimitExceeded,
    MemoryServiceError,
    NotFound,
    NotReady,
    status_code_for,
)
from memory_service.metrics import ServiceMetrics
from memory_service.steps import start_step_clock, step_done
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, KvKey
from memory_service.coordination import CoordinationStore, Job, WorkerReport
from memory_service.kv_pipeline import KvPipeline, Upload
from memory_service.kv_store import KvStoreBudgets, TieredKvStore
from memory_service.models import IngestOutcome, StoredFact
from memory_service.object_store import S3Settings, StoreLocation
from inferscale_kv.profile import profile_fields
from memory_service.profiles import validate_profile
from memory_service.sql import open_database
from memory_service.store import FactStore
from memory_service.validation import (
    decode_page_token,
    encode_page_token,
    resolve_page_size,
    resolve_top_k,
    validate_fact_ids,
    validate_facts,
    validate_id,
    validate_query_vector,
    validate_text,
    validate_turns,
)

log = structlog.get_logger(__name__)

REQUEST_ID_KEY = "x-request-id"
_OUTCOME_TO_PB = {
    IngestOutcome.CREATED: pb.INGEST_OUTCOME_CREATED,
    IngestOutcome.UPDATED: pb.INGEST_OUTCOME_UPDATED,
    IngestOutcome.UNCHANGED: pb.INGEST_OUTCOME_UNCHANGED,
}

Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Any, Request, grpc.aio.ServicerContext], Awaitable[Response]]


# GetStats lists the precompute workers that leased within this window.
WORKERS_SHOWN_FOR_S = 3600.0
# How long staged entries are expected to stay in the memory tier (LRU decides; this is what the handle promises).
STAGING_TTL_S = 60.0


def _timestamp(micros: int) -> Timestamp:
    timestamp = Timestamp()
    timestamp.FromMicroseconds(micros)
    return timestamp


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


def _usable_request_id(candidate: str | None) -> bool:
    """A client's request id is echoed in trailing metadata, so it must be a valid metadata value."""
    return bool(candidate) and len(candidate) <= 128 and all(" " <= char <= "~" for char in candidate)


# Threads for the blocking calls of RPCs that write, and of the workers' KV traffic (multi-MB blob writes): each
# kind on threads of its own (memory_service.blocking), never queued behind the reads' or each other's.
WRITE_METHODS = frozenset({"IngestTurns", "IngestFacts", "DeleteFacts", "DeleteUser", "AnnounceProfile"})
KV_WORK_METHODS = frozenset({"LeaseKvWork", "CompleteKvWork"})
WRITE_THREADS, KV_WORK_THREADS = 8, 4


def rpc(handler: Handler) -> Handler:
    """Wraps a servicer method: request id and logging context, access control, readiness, metrics, error mapping.

    This is the only place where domain errors become gRPC status codes.
    """
    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: MemoryServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        request_id = next((candidate for candidate in (metadata.get(REQUEST_ID_KEY), getattr(request, "request_id", ""))
                           if _usable_request_id(candidate)), None) or uuid.uuid4().hex
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(
            request_id=request_id, method=method, user_id=getattr(request, "user_id", None)
        )
        started = time.perf_counter()
        steps = start_step_clock()
        code = grpc.StatusCode.OK
        error: BaseException | None = None
        try:
            principal = self.access.authenticate(metadata)
            structlog.contextvars.bind_contextvars(caller=principal.name)
            principal.authorize(method, request)
            CALLER.set(principal)
            if not self.ready:
                raise NotReady("the memory service is starting; retry shortly")
            executor = self.executors.get(method)
            if executor is not None:
                with blocking_calls_on(executor):
                    return await handler(self, request, context)
            return await handler(self, request, context)
        except asyncio.CancelledError:  # the client cancelled or its deadline passed: no status to send
            code = grpc.StatusCode.CANCELLED
            raise
        except MemoryServiceError as exc:
            code, error = status_code_for(exc), exc
        except Exception as exc:  # noqa: BLE001 - a bug must become INTERNAL, not a dropped stream
            code, error = grpc.StatusCode.INTERNAL, exc
            log.exception("rpc_failed")
        finally:
            if steps.ms:
                steps.step_done("rest")
            elapsed = time.perf_counter() - started
            self.metrics.rpc_requests.labels(method=method, code=code.name).inc()
            self.metrics.rpc_duration.labels(method=method).observe(elapsed)
            log.info("rpc", code=code.name, duration_ms=round(elapsed * 1000, 3), error=str(error) if error else None,
                     **({"steps_ms": steps.ms} if steps.ms else {}))
        message = str(error) if code != grpc.StatusCode.INTERNAL else f"internal error (request id {request_id})"
        await context.abort(code, message)

    return wrapper


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    """Serves the API once `load` has opened the store and loaded the embedder."""

    def __init__(self, config: ServiceConfig, metrics: ServiceMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.limits = config.limits
        self.access = AccessControl.from_file(config.auth_file)
        self.embedder = Embedder(
            config.embedding_model, config.embedding_device, config.embedding_batch_size, config.embedding_threads,
            backend=config.embedding_backend, cache_dir=config.resolved_embedding_cache_dir,
            observe_query_batch=metrics.query_batch_queries.observe,
        )
        self.store: FactStore | None = None
        self.kv: KvPipeline | None = None
        self.ready = False
        writes = ThreadPoolExecutor(max_workers=WRITE_THREADS, thread_name_prefix="write")
        kv_work = ThreadPoolExecutor(max_workers=KV_WORK_THREADS, thread_name_prefix="kv-work")
        self.executors = {**dict.fromkeys(WRITE_METHODS, writes), **dict.fromkeys(KV_WORK_METHODS, kv_work)}

    async def load(self) -> None:
        await self.embedder.load()
        config = self.config
        location = StoreLocation.parse(config.store_uri, config.data_dir,
                                       S3Settings(config.s3_endpoint, config.s3_region, config.s3_allow_http))
        database = await asyncio.to_thread(open_database, config.coordination_url,
                                           config.data_dir / "kv" / "index.sqlite")
        coordination = await asyncio.to_thread(CoordinationStore, database, config.kv_max_attempts)
        self.metrics.watch_coordination(database)
        store = FactStore(location, coordination, config.embedding_model, self.embedder.dim,
                          search_cache_bytes=config.search_cache_mb << 20,
                          lancedb_cache_bytes=config.lancedb_cache_mb << 20)
        await store.open()
        budgets = KvStoreBudgets(
            gpu_bytes=config.kv_gpu_budget_mb << 20,
            host_bytes=config.kv_host_budget_mb << 20,
            disk_bytes=int(config.kv_disk_budget_gb * (1 << 30)),
        )
        durable = await asyncio.to_thread(location.durable_kv_tier, budgets.disk_bytes)
        kv_store = await asyncio.to_thread(TieredKvStore, coordination, durable, budgets)
        self.store = store
        self.kv = KvPipeline(store, kv_store)
        self.metrics.watch_kv(kv_store)
        await self.kv.reconcile()
        await self._refresh_stored_gauges()
        self.ready = True

    async def close(self) -> None:
        self.ready = False
        self.embedder.close()
        for executor in set(self.executors.values()):  # after server.stop(): handlers past their grace are cancelled
            executor.shutdown(wait=False, cancel_futures=True)
        if self.kv is not None:
            self.kv.kv.close()

    @property
    def _kv(self) -> KvPipeline:
        assert self.kv is not None
        return self.kv

    @property
    def _store(self) -> FactStore:
        assert self.store is not None
        return self.store

    async def _refresh_stored_gauges(self) -> None:
        facts, turns = await self._store.row_counts()
        self.metrics.facts_stored.set(facts)
        self.metrics.turns_stored.set(turns)

    async def _embed_for_ingest(self, texts: list[str]):
        with self.metrics.embedding_duration.labels(purpose="ingest").time():
            return await self.embedder.embed(texts)

    async def _search(self, user_id: str, request: pb.SearchFactsRequest | pb.RetrieveAndStageRequest, top_k: int):
        """The user's top-k facts for the request's query: its text embedded here, or the caller's vector."""
        if request.query_vector:
            query_vector = validate_query_vector(request.query_vector, request.embedding_model_id,
                                                 self.embedder.model_id, self.embedder.dim)
            self.metrics.caller_embedded_queries.inc()
        else:
            query = validate_text(request.query, "query", self.limits.max_query_chars)
            with self.metrics.embedding_duration.labels(purpose="query").time():  # includes waiting for its batch
                query_vector = await self.embedder.embed_query(query)
            step_done("embed")
        with self.metrics.retrieval_duration.time():
            results = await self._store.search(user_id, query_vector, top_k)
        step_done("search")
        self.metrics.facts_retrieved.inc(len(results))
        return results

    # ------------------------------------------------------------------ RPCs

    @rpc
    async def IngestTurns(self, request: pb.IngestTurnsRequest, context) -> pb.IngestTurnsResponse:
        user_id = validate_id(request.user_id, "user_id")
        turns = validate_turns(request.turns, self.limits)
        written = await self._store.ingest_turns(user_id, turns)
        await self._refresh_stored_gauges()
        return pb.IngestTurnsResponse(turns_written=written)

    @rpc
    async def IngestFacts(self, request: pb.IngestFactsRequest, context) -> pb.IngestFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        facts = validate_facts(request.facts, self.limits)
        self.metrics.ingest_batch_facts.observe(len(facts))
        tenant = CALLER.get()
        if tenant.max_kv_bytes is not None:
            held = await self._kv.kv_bytes_with_user_prefix(tenant.user_prefix)
            if held >= tenant.max_kv_bytes:
                raise LimitExceeded("facts", f"the users under {tenant.user_prefix!r} hold {held} bytes of fact KV, "
                                    f"the tenant's quota is {tenant.max_kv_bytes}")
        step_done("admit")
        tenant_quota = (tenant.user_prefix, tenant.max_facts) if tenant.max_facts is not None else None
        results = await self._store.ingest_facts(user_id, facts, self._embed_for_ingest,
                                                 self.limits.max_facts_per_user, tenant_quota)
        await self._kv.facts_changed(
            user_id, [(r.fact_id, r.version) for r in results if r.outcome is not IngestOutcome.UNCHANGED]
        )
        step_done("kv_queue")
        for result in results:
            self.metrics.facts_ingested.labels(outcome=result.outcome.value).inc()
        await self._refresh_stored_gauges()
        step_done("gauges")
        log.info("facts_ingested", facts=len(results))
        return pb.IngestFactsResponse(
            facts=[
                pb.IngestedFact(fact_id=r.fact_id, version=r.version, outcome=_OUTCOME_TO_PB[r.outcome])
                for r in results
            ]
        )

    @rpc
    async def SearchFacts(self, request: pb.SearchFactsRequest, context) -> pb.SearchFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        top_k = resolve_top_k(request.top_k, self.limits)
        results = await self._search(user_id, request, top_k)
        return pb.SearchFactsResponse(
            facts=[
                pb.ScoredFact(fact=_fact_message(r.fact), score=r.score, rank=rank)
                for rank, r in enumerate(results, start=1)
            ]
        )

    @rpc
    async def RetrieveAndStage(self, request: pb.RetrieveAndStageRequest, context) -> pb.RetrieveAndStageResponse:
        user_id = validate_id(request.user_id, "user_id")
        top_k = resolve_top_k(request.top_k, self.limits)
        profile_id = validate_profile(request.profile)
        validate_id(request.node_id, "node_id")
        await self._kv.announce(profile_id, profile_fields(request.profile))
        step_done("announce")
        results = await self._search(user_id, request, top_k)
        entries = await self._kv.entries(profile_id, user_id, [r.fact for r in results])
        header = await self._kv.header_entry(profile_id)
        step_done("kv_index")
        facts = []
        for rank, r in enumerate(results, start=1):
            entry = entries.get(r.fact.fact_id)
            facts.append(pb.RetrievedFact(
                fact_id=r.fact.fact_id, version=r.fact.version, text=r.fact.text, score=r.score, rank=rank,
                token_ids=entry.token_ids if entry else [], kv_ready=entry is not None,
                kv_bytes=entry.nbytes if entry else 0, content_id=entry.key.content_id if entry else "",
                created_at=_timestamp(r.fact.created_at_us),
            ))
        self.metrics.kv_lookups.inc(len(results))
        self.metrics.kv_ready.inc(len(entries))
        ready = [entries[f.fact_id] for f in facts if f.kv_ready]
        header_content_id = header.key.content_id if header else ""
        if not ready:
            return pb.RetrieveAndStageResponse(facts=facts, header_content_id=header_content_id)
        self._kv.stage(([header.key] if header else []) + [entry.key for entry in ready])
        covered = "|".join(f"{e.key.fact_id}@{e.key.version}.{e.key.content_id}" for e in ready)
        digest = hashlib.sha256(f"{profile_id}|{user_id}|{request.node_id}|{covered}".encode()).hexdigest()
        staging = pb.StagingHandle(
            handle_id=f"stg-{digest[:24]}", fact_ids=[e.key.fact_id for e in ready],
            total_bytes=sum(e.nbytes for e in ready),
            expires_at=_timestamp(int((time.time() + STAGING_TTL_S) * 1_000_000)))
        return pb.RetrieveAndStageResponse(facts=facts, staging=staging, header_content_id=header_content_id)

    @rpc
    async def ListFacts(self, request: pb.ListFactsRequest, context) -> pb.ListFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        page_size = resolve_page_size(request.page_size, self.limits)
        after = decode_page_token(request.page_token)
        facts, more = await self._store.list_facts(user_id, after, page_size)
        return pb.ListFactsResponse(
            facts=[_fact_message(fact) for fact in facts],
            next_page_token=encode_page_token(facts[-1].fact_id) if more else "",
        )

    @rpc
    async def DeleteFacts(self, request: pb.DeleteFactsRequest, context) -> pb.DeleteFactsResponse:
        user_id = validate_id(request.user_id, "user_id")
        fact_ids = validate_fact_ids(request.fact_ids, self.limits)
        counts = await self._store.counts(user_id)
        if not counts.users:
            raise NotFound(f"user_id: {user_id!r} has nothing stored")
        deleted = await self._store.delete_facts(user_id, fact_ids)
        await self._kv.facts_deleted(user_id, fact_ids)
        await self._refresh_stored_gauges()
        deleted_set = set(deleted)
        return pb.DeleteFactsResponse(
            facts_deleted=len(deleted),
            not_found_fact_ids=[fact_id for fact_id in fact_ids if fact_id not in deleted_set],
        )

    @rpc
    async def DeleteUser(self, request: pb.DeleteUserRequest, context) -> pb.DeleteUserResponse:
        user_id = validate_id(request.user_id, "user_id")
        facts, turns = await self._store.delete_user(user_id)
        await self._kv.facts_deleted(user_id, None)
        if not facts and not turns:
            raise NotFound(f"user_id: {user_id!r} has nothing stored")
        await self._refresh_stored_gauges()
        return pb.DeleteUserResponse(facts_deleted=facts, turns_deleted=turns)

    @rpc
    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        user_id = validate_id(request.user_id, "user_id") if request.user_id else ""
        counts = await self._store.counts(user_id)
        profiles = []
        for profile_id, spec in self._kv.index.profiles().items():
            queue = await run_blocking(self._kv.counts, profile_id, user_id)
            profiles.append(pb.ProfileKvStats(
                profile_id=profile_id, model=spec["model"], context_window=spec["context_window"],
                kv_dtype=spec["kv_dtype"], queued=queue.queued, leased=queue.leased, done=queue.done,
                failed=queue.failed, lag_seconds=queue.lag_seconds, kv_bytes=queue.kv_bytes,
            ))
        # Tier figures are service-wide: a credential confined to a tenant's users does not see them.
        tiers = [] if CALLER.get().user_prefix else [
            pb.KvTierStats(name=tier.name, entries=tier.stats.entries, bytes=tier.stats.bytes,
                           budget_bytes=tier.budget_bytes, hits=tier.stats.hits, lookups=tier.stats.lookups,
                           evictions=tier.stats.evictions)
            for tier in self._kv.kv.tiers
        ]
        now = time.time()
        workers = [] if CALLER.get().user_prefix else [
            pb.WorkerStats(worker_id=w.worker_id, profile_id=w.profile_id, last_seen_seconds_ago=now - w.last_seen,
                           facts_per_second=w.facts_per_second, device=pb.WorkerDevice(**w.device))
            for w in await run_blocking(self._kv.index.workers, WORKERS_SHOWN_FOR_S)
        ]
        return pb.GetStatsResponse(
            users=counts.users,
            facts=counts.facts,
            turns=counts.turns,
            embedding_model=self.embedder.model_name,
            embedding_dim=self.embedder.dim,
            embedding_model_id=self.embedder.model_id,
            profiles=profiles,
            tiers=tiers,
            workers=workers,
        )

    @rpc
    async def AnnounceProfile(self, request: pb.AnnounceProfileRequest, context) -> pb.AnnounceProfileResponse:
        profile_id = validate_profile(request.profile)
        validate_id(request.announcer_id, "announcer_id")
        queued = await self._kv.announce(profile_id, profile_fields(request.profile), request.header_kv)
        return pb.AnnounceProfileResponse(profile_id=profile_id, facts_queued=queued)

    @rpc
    async def LeaseKvWork(self, request: pb.LeaseKvWorkRequest, context) -> pb.LeaseKvWorkResponse:
        validate_id(request.worker_id, "worker_id")
        profile_id = validate_id(request.profile_id, "profile_id")
        if request.max_facts < 0 or request.lease_seconds < 0:
            raise InvalidArgument("max_facts" if request.max_facts < 0 else "lease_seconds", "must not be negative")
        max_facts = min(request.max_facts or self.config.kv_lease_max_facts, self.config.kv_lease_max_facts)
        if not math.isfinite(request.facts_per_second) or request.facts_per_second < 0:
            raise InvalidArgument("facts_per_second", "must be a finite, non-negative rate")
        device = request.device
        await run_blocking(self._kv.index.record_worker, WorkerReport(
            request.worker_id, profile_id, time.time(), request.facts_per_second,
            {"name": device.name, "memory_total_bytes": device.memory_total_bytes,
             "memory_used_bytes": device.memory_used_bytes, "utilization_percent": device.utilization_percent}
            if request.HasField("device") else {}))
        lease = await self._kv.lease(profile_id, max_facts, request.lease_seconds or self.config.kv_lease_seconds)
        response = pb.LeaseKvWorkResponse(lease_id=lease.lease_id,
                                           header_kv_wanted=await self._kv.header_entry(profile_id) is None)
        if not lease.facts:
            return response
        response.expires_at.FromMicroseconds(int(lease.expires_at * 1_000_000))
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
        self.metrics.kv_facts_leased.inc(len(lease.facts))
        log.info("kv_work_leased", worker_id=request.worker_id, facts=len(lease.facts), lease_id=lease.lease_id)
        return response

    @rpc
    async def CompleteKvWork(self, request: pb.CompleteKvWorkRequest, context) -> pb.CompleteKvWorkResponse:
        validate_id(request.worker_id, "worker_id")
        profile_id = validate_id(request.profile_id, "profile_id")
        uploads = [Upload(r.user_id, r.fact_id, r.version, r.blob) for r in request.results]
        failures = [(Job(profile_id, f.user_id, f.fact_id, f.version), f.error) for f in request.failures]
        counts = await self._kv.complete(profile_id, request.lease_id, uploads, failures)
        self.metrics.kv_uploads.labels(outcome="accepted").inc(counts.accepted)
        self.metrics.kv_uploads.labels(outcome="duplicate").inc(counts.duplicates)
        self.metrics.kv_uploads.labels(outcome="stale").inc(counts.stale)
        self.metrics.kv_work_failures.inc(len(failures))
        return pb.CompleteKvWorkResponse(accepted=counts.accepted, duplicates=counts.duplicates, stale=counts.stale)

    @rpc
    async def FetchKv(self, request: pb.FetchKvRequest, context):
        profile_id = validate_id(request.profile_id, "profile_id")
        user_id = validate_id(request.user_id, "user_id")
        for index, ref in enumerate(request.facts):
            validate_id(ref.fact_id, f"facts[{index}].fact_id")
        if request.include_header:
            key = KvKey(profile_id, HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, request.header_content_id)
            blob = await self._kv.fetch(key)
            await context.write(pb.FetchKvResponse(fact_id=HEADER_FACT_ID, version=HEADER_VERSION, blob=blob or b"",
                                                   content_id=key.content_id))
        for ref in request.facts:
            blob = await self._kv.fetch(KvKey(profile_id, user_id, ref.fact_id, ref.version, ref.content_id))
            await context.write(pb.FetchKvResponse(fact_id=ref.fact_id, version=ref.version, blob=blob or b"",
                                                   content_id=ref.content_id))
