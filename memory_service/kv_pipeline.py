"""The KV pipeline: which facts need KV for which profile, leasing that work to precompute workers, accepting their
uploads, and serving stored KV. Wire-format free: the servicer translates messages, and its inputs are
validated (memory_service.validation)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import structlog

from inferscale_kv.kv_key import KvKey
from memory_service.blocking import run_blocking
from memory_service.coordination.kv_index import KvEntry, KvIndex
from memory_service.coordination.profiles import ProfileRegistry
from memory_service.coordination.work_queue import Job, KvWorkQueue
from memory_service.coordination.workers import WorkerDevice, WorkerRegistry, WorkerReport
from memory_service.errors import NotFound
from memory_service.fact_store import FactStore
from memory_service.kv_store import TieredKvStore
from memory_service.models import AnnouncedProfile, KvUpload, StoredFact, StoredTurn

log = structlog.get_logger(__name__)

# Blobs FetchKv holds at once, over every call (each ~4.4 MiB at the Llama-3-8B shape, about three copies while it
# is written out): the service's memory for fetches is bounded whatever the number of streams.
FETCH_BLOBS_IN_FLIGHT = 32
# How long a staging handle is meant to be used for: the facts it names may change (and their KV with them) after it.
STAGING_TTL_S = 60.0


@dataclass(frozen=True)
class LeaseRequest:
    """A precompute worker's request for work, with what it reports of itself."""

    worker_id: str
    profile_id: str
    max_facts: int  # 0: the service's largest lease
    lease_seconds: float  # 0: the service's default
    facts_per_second: float
    device: WorkerDevice | None


@dataclass(frozen=True)
class KvWorkLease:
    lease_id: str  # empty when no fact was leased
    expires_at: float  # seconds since the epoch
    facts: list[StoredFact]
    turns_by_user: dict[str, list[StoredTurn]]  # each user's turns up to the latest source turn of its facts
    header_wanted: bool  # the profile's header KV is not stored: the worker should announce it


@dataclass(frozen=True)
class CompletionCounts:
    accepted: int = 0
    duplicates: int = 0
    stale: int = 0


@dataclass(frozen=True)
class StagingHandle:
    """What a RetrieveAndStage found ready: the facts whose KV a node may fetch (FetchKv); no bytes move before it
    does."""

    handle_id: str
    fact_ids: list[str]
    total_bytes: int
    expires_at: float  # seconds since the epoch


@dataclass(frozen=True)
class ProfileKvCounts:
    """A profile's KV progress (of one user, or of all users)."""

    queued: int
    leased: int
    done: int
    failed: int
    kv_bytes: int
    lag_seconds: float


class KvPipeline:
    """Fact KV from queue to node: what the RPCs of profiles, workers and nodes do with KV (blocking calls on
    memory_service.blocking's threads)."""

    def __init__(self, fact_store: FactStore, kv_store: TieredKvStore, profile_registry: ProfileRegistry,
                 work_queue: KvWorkQueue, kv_index: KvIndex, worker_registry: WorkerRegistry, lease_max_facts: int,
                 lease_seconds: float) -> None:
        """`lease_max_facts`, `lease_seconds`: a lease's largest size and its default length."""
        self._fact_store = fact_store
        self._kv_store = kv_store
        self._profile_registry = profile_registry
        self._work_queue = work_queue
        self._kv_index = kv_index
        self._worker_registry = worker_registry
        self._lease_max_facts = lease_max_facts
        self._lease_seconds = lease_seconds
        self._announced: set[str] = set()  # profiles known to the registry (skip the write on the request path)
        self._fetch_slots = asyncio.Semaphore(FETCH_BLOBS_IN_FLIGHT)

    # ------------------------------------------------------------------ profiles

    async def announce(self, profile: AnnouncedProfile, header_kv: KvUpload | None = None) -> int:
        """Registers a profile (and stores its header KV when given and not stored yet); a new profile gets every
        stored fact queued. Returns facts queued."""
        if header_kv is not None and await self.header_entry(profile.profile_id) is None:
            await run_blocking(self._kv_store.put, header_kv.key, header_kv.blob, header_kv.token_ids, None)
        if profile.profile_id in self._announced:
            return 0
        is_new = await run_blocking(self._profile_registry.add, profile.profile_id, profile.fields)
        self._announced.add(profile.profile_id)
        if not is_new:
            return 0
        versions = await self._fact_store.fact_versions()
        queued = await run_blocking(self._work_queue.enqueue, [profile.profile_id], versions)
        log.info("profile_announced", profile_id=profile.profile_id, facts_queued=queued, **profile.fields)
        return queued

    def profiles(self) -> dict[str, dict]:
        """profile_id -> fields, of every announced profile (blocking)."""
        return self._profile_registry.all()

    async def header_entry(self, profile_id: str) -> KvEntry | None:
        return await run_blocking(self._kv_index.header_entry, profile_id)

    async def _require_profile(self, profile_id: str) -> None:
        if profile_id not in self._announced and profile_id not in await run_blocking(self.profiles):
            raise NotFound(f"profile_id: {profile_id!r} was never announced (call AnnounceProfile first)")

    # ------------------------------------------------------------------ facts

    async def reconcile(self) -> int:
        """After a restart: the durable tier and the index agree, and every fact lacking KV for a profile is queued.
        Not with a shared store: other replicas write while this one starts, and a scan could take their new entries
        for stale ones (missing KV is queued by RetrieveAndStage anyway)."""
        if self._kv_store.shared:
            return 0
        await run_blocking(self._kv_store.reconcile)
        current = {(user, fact): version for user, fact, version in await self._fact_store.fact_versions()}
        entry_keys = self._kv_index.all_entry_keys()
        covered = {(k.profile_id, k.user_id, k.fact_id, k.version) for k in entry_keys}
        covered |= {(job.profile_id, job.user_id, job.fact_id, job.version) for job in self._work_queue.all_jobs()}
        stale = [k for k in entry_keys if not k.is_header and current.get((k.user_id, k.fact_id)) != k.version]
        await run_blocking(self._kv_store.forget_entries, stale)
        queued = 0
        for profile_id in self._profile_registry.all():
            missing = [(u, f, v) for (u, f), v in current.items() if (profile_id, u, f, v) not in covered]
            queued += self._work_queue.enqueue([profile_id], missing)
        if queued or stale:
            log.info("kv_queue_reconciled", queued=queued, stale_entries=len(stale))
        return queued

    async def facts_changed(self, user_id: str, changed: Sequence[tuple[str, int]]) -> None:
        """Created or updated facts: drop KV of older versions, queue the new version for every profile."""
        if not changed:
            return
        await run_blocking(self._kv_store.forget, user_id, [fact_id for fact_id, _ in changed])
        profiles = list(await run_blocking(self.profiles))
        await run_blocking(self._work_queue.enqueue, profiles, [(user_id, f, v) for f, v in changed])

    async def facts_deleted(self, user_id: str, fact_ids: Sequence[str] | None) -> None:
        """Deletes every KV blob and queued job of the facts (all of the user's when None)."""
        await run_blocking(self._kv_store.forget, user_id, fact_ids)

    # ------------------------------------------------------------------ workers

    async def lease(self, request: LeaseRequest) -> KvWorkLease:
        """Records the worker's report and leases it queued facts of the profile, with the turns they were said in."""
        await self._require_profile(request.profile_id)
        await run_blocking(self._worker_registry.record, WorkerReport(
            request.worker_id, request.profile_id, time.time(), request.facts_per_second, request.device))
        max_facts = min(request.max_facts or self._lease_max_facts, self._lease_max_facts)
        leased = await run_blocking(self._work_queue.lease, request.profile_id, max_facts,
                                    request.lease_seconds or self._lease_seconds)
        by_user: dict[str, list[Job]] = {}
        for job in leased.jobs:
            by_user.setdefault(job.user_id, []).append(job)
        facts: list[StoredFact] = []
        turns_by_user: dict[str, list[StoredTurn]] = {}
        for user_id, user_jobs in by_user.items():
            stored = await self._fact_store.facts_by_ids(user_id, [job.fact_id for job in user_jobs])
            user_facts = [stored[job.fact_id] for job in user_jobs if job.fact_id in stored
                          and stored[job.fact_id].version == job.version]
            facts.extend(user_facts)
            sources = {fact.source_turn_id for fact in user_facts if fact.source_turn_id}
            if sources:
                turns = await self._fact_store.turns_of_user(user_id)
                last = max((i for i, turn in enumerate(turns) if turn.turn_id in sources), default=-1)
                turns_by_user[user_id] = turns[: last + 1]
        header_wanted = await self.header_entry(request.profile_id) is None
        return KvWorkLease(leased.lease_id if facts else "", leased.expires_at, facts, turns_by_user, header_wanted)

    async def complete(self, profile_id: str, lease_id: str, uploads: Sequence[KvUpload],
                       failures: Sequence[tuple[Job, str]]) -> CompletionCounts:
        """Stores uploads that their lease still covers (same version, same lease, in the transaction that records
        them); a fact deleted, changed or re-leased since counts as stale and nothing of it is stored. Failures
        return their jobs to the queue (or mark them failed)."""
        await self._require_profile(profile_id)
        accepted = duplicates = stale = 0
        for upload in uploads:
            key = upload.key
            if await run_blocking(self._kv_store.put, key, upload.blob, upload.token_ids, lease_id):
                accepted += 1
            elif (entry := self._kv_index.entry(profile_id, key.user_id, key.fact_id)) and entry.key == key:
                duplicates += 1
            else:
                stale += 1
        for job, error in failures:
            await run_blocking(self._work_queue.fail, job, lease_id, error)
        return CompletionCounts(accepted, duplicates, stale)

    # ------------------------------------------------------------------ serving

    async def entries(self, profile_id: str, user_id: str, facts: Sequence[StoredFact]) -> dict[str, KvEntry]:
        """Stored KV of the current versions of `facts`; facts lacking it (and not queued) get queued."""
        return await run_blocking(self._entries_blocking, profile_id, user_id, facts)

    def _entries_blocking(self, profile_id: str, user_id: str, facts: Sequence[StoredFact]) -> dict[str, KvEntry]:
        fact_ids = [f.fact_id for f in facts]
        entries = self._kv_index.entries(profile_id, user_id, fact_ids)
        versions = {f.fact_id: f.version for f in facts}
        current = {fid: e for fid, e in entries.items() if versions[fid] == e.key.version}
        lacking = [f for f in facts if f.fact_id not in current]
        jobs = self._work_queue.job_versions(profile_id, user_id, [f.fact_id for f in lacking])
        missing = [(user_id, f.fact_id, f.version) for f in lacking if jobs.get(f.fact_id) != f.version]
        if missing:
            self._work_queue.enqueue([profile_id], missing)
        return current

    def stage(self, profile_id: str, user_id: str, node_id: str, ready: Sequence[KvEntry]) -> StagingHandle:
        """The handle naming, for `node_id`, the user's facts whose KV is `ready` to fetch. Nothing is read or moved
        here: a node fetches what its cache lacks (`fetch`), and only that travels."""
        covered = "|".join(f"{e.key.fact_id}@{e.key.version}.{e.key.content_id}" for e in ready)
        digest = hashlib.sha256(f"{profile_id}|{user_id}|{node_id}|{covered}".encode()).hexdigest()
        return StagingHandle(handle_id=f"stg-{digest[:24]}", fact_ids=[e.key.fact_id for e in ready],
                             total_bytes=sum(e.nbytes for e in ready), expires_at=time.time() + STAGING_TTL_S)

    async def fetch(self, keys: Sequence[KvKey]) -> AsyncIterator[tuple[KvKey, bytes | None]]:
        """Each key with its blob, in order: None where the index does not list exactly that key when its turn comes
        (checked just before each read, so a delete acknowledged meanwhile stops the rest of a stream). One blob at a
        time per call, and at most FETCH_BLOBS_IN_FLIGHT across calls: each is held from its read until the caller
        has taken it (streamed it), so many slow fetches cannot pile blobs up in memory."""
        for key in keys:
            async with self._fetch_slots:
                yield key, await run_blocking(self._kv_store.get, key)

    # ------------------------------------------------------------------ accounting

    def counts(self, profile_id: str, user_id: str = "") -> ProfileKvCounts:
        """The profile's KV progress (blocking)."""
        queue = self._work_queue.counts(profile_id, user_id)
        stored = self._kv_index.stored(profile_id, user_id)
        return ProfileKvCounts(queued=queue.queued, leased=queue.leased, done=stored.done, failed=queue.failed,
                               kv_bytes=stored.kv_bytes, lag_seconds=queue.lag_seconds)

    async def kv_bytes_with_user_prefix(self, prefix: str) -> int:
        return await run_blocking(self._kv_index.kv_bytes_with_user_prefix, prefix)

    def recent_workers(self, seen_within_s: float) -> list[WorkerReport]:
        """Workers that leased within the last `seen_within_s` seconds, most recent first (blocking)."""
        return self._worker_registry.recent(seen_within_s)
