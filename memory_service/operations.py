"""The memory service's operations, one per RPC of inferscale.v1.MemoryService: validated domain records in
(memory_service.validation), domain results out, wire-format free. The servicer translates messages; what the service
decides is here and below (the fact store, the KV pipeline)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, KvKey
from memory_service.access import Principal
from memory_service.blocking import run_blocking
from memory_service.config import Limits
from memory_service.coordination.kv_index import KvEntry
from memory_service.coordination.work_queue import Job, lease_digest
from memory_service.coordination.workers import WorkerReport
from memory_service.embedder import Embedder
from memory_service.errors import LimitExceeded, NotFound, NotLeaseHolder
from memory_service.fact_store import FactStore
from memory_service.kv_pipeline import (
    AuditOutcome,
    AuditResult,
    CompletionCounts,
    HeaderOutcome,
    KvPipeline,
    KvWorkLease,
    LeaseRequest,
    ProfileKvCounts,
)
from memory_service.kv_store import TieredKvStore
from memory_service.kv_tiers import TierStats
from memory_service.metrics import ServiceMetrics
from memory_service.models import (
    AnnouncedProfile,
    Announcer,
    FactKvRef,
    IngestOutcome,
    IngestResult,
    KvUpload,
    NewFact,
    NewTurn,
    Query,
    RetrievalMode,
    ScoredFact,
    StoreCounts,
    StoredFact,
)
from memory_service.retrieval import candidates, fuse
from memory_service.steps import step_done

log = structlog.get_logger(__name__)

# GetStats lists the precompute workers that leased within this window.
WORKERS_SHOWN_FOR_S = 3600.0


@dataclass(frozen=True)
class RetrievalRequest:
    user_id: str
    top_k: int
    profile: AnnouncedProfile
    query: Query
    mode: RetrievalMode


@dataclass(frozen=True)
class RetrievedFact:
    fact: StoredFact
    score: float
    kv: KvEntry | None  # the fact's stored KV at its current version, if ready


@dataclass(frozen=True)
class Retrieval:
    facts: list[RetrievedFact]  # best first
    header_content_id: str  # of the profile's header KV; empty when it is not stored


@dataclass(frozen=True)
class ProfileStats:
    profile_id: str
    fields: dict
    counts: ProfileKvCounts


@dataclass(frozen=True)
class TierReport:
    name: str
    stats: TierStats
    budget_bytes: int


@dataclass(frozen=True)
class ServiceStats:
    counts: StoreCounts
    embedding_model: str
    embedding_dim: int
    embedding_model_id: str
    profiles: list[ProfileStats]
    tiers: list[TierReport]  # empty for a caller confined to a tenant's users (the figures are service-wide)
    workers: list[WorkerReport]  # idem
    taken_at: float  # seconds since the epoch


class MemoryOperations:
    """One method per RPC; raises the domain errors of memory_service.errors (the rpc wrapper maps them)."""

    def __init__(self, fact_store: FactStore, kv_pipeline: KvPipeline, kv_store: TieredKvStore, embedder: Embedder,
                 metrics: ServiceMetrics, limits: Limits) -> None:
        self._fact_store = fact_store
        self._kv_pipeline = kv_pipeline
        self._kv_store = kv_store
        self._embedder = embedder
        self._metrics = metrics
        self._limits = limits

    async def refresh_stored_gauges(self) -> None:
        facts, turns = await self._fact_store.row_counts()
        self._metrics.facts_stored.set(facts)
        self._metrics.turns_stored.set(turns)

    # ------------------------------------------------------------------ facts and turns

    async def ingest_turns(self, user_id: str, turns: Sequence[NewTurn]) -> int:
        """Stores (or overwrites, by turn_id) the user's turns; returns the turns written."""
        written = await self._fact_store.ingest_turns(user_id, turns)
        await self.refresh_stored_gauges()
        return written

    async def ingest_facts(self, user_id: str, facts: Sequence[NewFact], tenant: Principal) -> list[IngestResult]:
        """Stores the facts (FactStore.ingest_facts) within the user's and the tenant's quotas, and queues the KV of
        every new version for every profile."""
        self._metrics.ingest_batch_facts.observe(len(facts))
        if tenant.max_kv_bytes is not None:
            held = await self._kv_pipeline.kv_bytes_with_user_prefix(tenant.user_prefix)
            if held >= tenant.max_kv_bytes:
                raise LimitExceeded("facts", f"the users under {tenant.user_prefix!r} hold {held} bytes of fact KV, "
                                    f"the tenant's quota is {tenant.max_kv_bytes}")
        step_done("admit")
        tenant_quota = (tenant.user_prefix, tenant.max_facts) if tenant.max_facts is not None else None
        results = await self._fact_store.ingest_facts(user_id, facts, self._embed_for_ingest,
                                                      self._limits.max_facts_per_user, tenant_quota)
        await self._kv_pipeline.facts_changed(
            user_id, [(r.fact_id, r.version) for r in results if r.outcome is not IngestOutcome.UNCHANGED])
        step_done("kv_queue")
        for result in results:
            self._metrics.facts_ingested.labels(outcome=result.outcome.value).inc()
        await self.refresh_stored_gauges()
        step_done("gauges")
        log.info("facts_ingested", facts=len(results))
        return results

    async def _embed_for_ingest(self, texts: list[str]) -> np.ndarray:
        with self._metrics.embedding_duration.labels(purpose="ingest").time():
            return await self._embedder.embed(texts)

    async def search(self, user_id: str, query: Query, top_k: int, mode: RetrievalMode) -> list[ScoredFact]:
        """The user's top-k facts for the query, best first, ranked as `mode` says (models.RetrievalMode): by the
        query's embedding (its text embedded here, or the caller's vector), by its text's keywords, or both fused
        (memory_service.retrieval)."""
        if mode is RetrievalMode.KEYWORD:
            with self._metrics.retrieval_duration.time():
                results = await self._fact_store.keyword_search(user_id, query.text, top_k)
        elif mode is RetrievalMode.VECTOR:
            query_vector = await self._query_vector(query)
            with self._metrics.retrieval_duration.time():
                results = await self._fact_store.search(user_id, query_vector, top_k)
        else:  # the keyword search (LanceDB's threads) runs while the query is embedded and ranked by vector
            depth = candidates(top_k)
            async with asyncio.TaskGroup() as searches:
                by_keyword = searches.create_task(self._fact_store.keyword_search(user_id, query.text, depth))
                query_vector = await self._query_vector(query)
                with self._metrics.retrieval_duration.time():
                    by_vector = await self._fact_store.search(user_id, query_vector, depth)
                    results = fuse(by_vector, await by_keyword, query.text, top_k)
        step_done("search")
        self._metrics.facts_retrieved.inc(len(results))
        return results

    async def _query_vector(self, query: Query) -> np.ndarray:
        """The caller's vector, or the query's text embedded here."""
        if query.vector is not None:
            self._metrics.caller_embedded_queries.inc()
            return query.vector
        with self._metrics.embedding_duration.labels(purpose="query").time():  # includes waiting for its batch
            vector = await self._embedder.embed_query(query.text)
        step_done("embed")
        return vector

    async def list_facts(self, user_id: str, after_fact_id: str, page_size: int) -> tuple[list[StoredFact], bool]:
        """One page of the user's facts in fact_id order after `after_fact_id`, and whether more follow."""
        return await self._fact_store.list_facts(user_id, after_fact_id, page_size)

    async def delete_facts(self, user_id: str, fact_ids: Sequence[str]) -> list[str]:
        """Deletes the facts and their KV; returns the ids that existed. NotFound when the user has nothing."""
        if not (await self._fact_store.counts(user_id)).users:
            raise NotFound(f"user_id: {user_id!r} has nothing stored")
        deleted = await self._fact_store.delete_facts(user_id, fact_ids)
        await self._kv_pipeline.facts_deleted(user_id, fact_ids)
        await self.refresh_stored_gauges()
        return deleted

    async def delete_user(self, user_id: str) -> tuple[int, int]:
        """Deletes the user's facts, turns and KV; returns (facts, turns) deleted. NotFound when it had nothing."""
        facts, turns = await self._fact_store.delete_user(user_id)
        await self._kv_pipeline.facts_deleted(user_id, None)
        if not facts and not turns:
            raise NotFound(f"user_id: {user_id!r} has nothing stored")
        await self.refresh_stored_gauges()
        return facts, turns

    async def stats(self, user_id: str, tenant: Principal) -> ServiceStats:
        """Counts of the user (of every user when empty), each profile's KV progress and, for a caller not confined
        to a tenant's users, the KV tiers and the workers."""
        counts = await self._fact_store.counts(user_id)
        profiles = [ProfileStats(profile_id, fields,
                                 await run_blocking(self._kv_pipeline.counts, profile_id, user_id))
                    for profile_id, fields in (await run_blocking(self._kv_pipeline.profiles)).items()]
        service_wide = not tenant.user_prefix
        tiers = [TierReport(tier.name, dataclasses.replace(tier.stats), tier.budget_bytes)
                 for tier in self._kv_store.tiers] if service_wide else []
        workers = await run_blocking(self._kv_pipeline.recent_workers, WORKERS_SHOWN_FOR_S) if service_wide else []
        return ServiceStats(counts, self._embedder.model_name, self._embedder.dim, self._embedder.model_id, profiles,
                            tiers, workers, time.time())

    # ------------------------------------------------------------------ KV

    async def retrieve_and_stage(self, request: RetrievalRequest) -> Retrieval:
        """Announces the caller's profile and retrieves the user's top-k facts with their stored KV (queueing what
        lacks it): index lookups only, no KV is read (a node fetches what its cache lacks)."""
        profile_id, user_id = request.profile.profile_id, request.user_id
        await self._kv_pipeline.announce(request.profile)
        step_done("announce")
        results = await self.search(user_id, request.query, request.top_k, request.mode)
        entries, header = await self._kv_pipeline.serving_entries(profile_id, user_id, [r.fact for r in results])
        step_done("kv_index")
        self._metrics.kv_lookups.inc(len(results))
        self._metrics.kv_ready.inc(len(entries))
        facts = [RetrievedFact(r.fact, r.score, entries.get(r.fact.fact_id)) for r in results]
        return Retrieval(facts, header.key.content_id if header else "")

    async def announce_profile(self, profile: AnnouncedProfile, header_kv: KvUpload | None, announcer: Announcer,
                               caller: Principal) -> int:
        """KvPipeline.announce: returns the facts queued for a new profile. Header KV comes from workers only
        (Principal.authorize_kv_upload: the caller's credential, or the role the request declares), under the
        identity the caller's credential binds the announcer_id to (Principal.worker_identity)."""
        announcer_id = announcer.announcer_id
        if header_kv is not None:
            caller.authorize_kv_upload("header_kv", announcer.role)
            announcer_id = caller.worker_identity(announcer_id, "announcer_id")
        announcement = await self._kv_pipeline.announce(profile, header_kv, announcer_id)
        if announcement.header is HeaderOutcome.CONFLICT:
            self._metrics.kv_header_conflicts.inc()
        if announcement.audit is not None:
            self._count_audit(announcement.audit)
        return announcement.facts_queued

    async def lease_kv_work(self, request: LeaseRequest, caller: Principal) -> KvWorkLease:
        """KvPipeline.lease, under the identity the caller's credential binds the worker_id to
        (Principal.worker_identity)."""
        lease = await self._kv_pipeline.lease(request, caller.worker_identity(request.worker_id, "worker_id"))
        self._metrics.kv_audits.labels(outcome=AuditOutcome.ABANDONED.value).inc(lease.audits_abandoned)
        if lease.facts:
            self._metrics.kv_facts_leased.inc(len(lease.facts))
            log.info("kv_work_leased", worker_id=request.worker_id, facts=len(lease.facts),
                     lease_digest=lease_digest(lease.lease_id))
        return lease

    async def complete_kv_work(self, profile_id: str, lease_id: str, uploads: Sequence[KvUpload],
                               failures: Sequence[tuple[Job, str]], worker_id: str,
                               caller: Principal) -> CompletionCounts:
        """KvPipeline.complete, for workers only (Principal.authorize_kv_upload), under the identity the caller's
        credential binds the worker_id to (Principal.worker_identity)."""
        if uploads:
            caller.authorize_kv_upload("results", "worker")
        identity = caller.worker_identity(worker_id, "worker_id")
        try:
            counts = await self._kv_pipeline.complete(profile_id, lease_id, uploads, failures, identity)
        except NotLeaseHolder:
            self._metrics.kv_foreign_lease_completions.inc()
            log.warning("kv_completion_refused", worker_id=worker_id, identity=identity,
                        lease_digest=lease_digest(lease_id), results=len(uploads), failures=len(failures),
                        reason="not a lease held by this worker identity: nothing stored")
            raise
        self._metrics.kv_uploads.labels(outcome="accepted").inc(counts.accepted)
        self._metrics.kv_uploads.labels(outcome="duplicate").inc(counts.duplicates)
        self._metrics.kv_uploads.labels(outcome="stale").inc(counts.stale)
        self._metrics.kv_work_failures.inc(len(failures))
        for audit in counts.audits:
            self._count_audit(audit)
        return counts

    def _count_audit(self, audit: AuditResult) -> None:
        self._metrics.kv_audits.labels(outcome=audit.outcome.value).inc()
        log.info("kv_audited", outcome=audit.outcome.value, profile_id=audit.key.profile_id,
                 user_id=audit.key.user_id, fact_id=audit.key.fact_id, version=audit.key.version,
                 producer=audit.producer, auditor=audit.auditor, difference=audit.difference)

    async def fetch_kv(self, profile_id: str, user_id: str, facts: Sequence[FactKvRef],
                       header_content_id: str | None) -> AsyncIterator[tuple[KvKey, bytes]]:
        """Each requested blob (the profile's header first, when `header_content_id` is given), empty where the
        index lists nothing under exactly that key."""
        keys = [KvKey(profile_id, HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, header_content_id)
                ] if header_content_id is not None else []
        keys += [KvKey(profile_id, user_id, ref.fact_id, ref.version, ref.content_id) for ref in facts]
        async for key, blob in self._kv_pipeline.fetch(keys):
            self._metrics.kv_fetched_blobs.labels(outcome="served" if blob else "missing").inc()
            yield key, blob or b""
