"""The KV pipeline: which facts need KV for which profile, leasing that work to precompute workers, accepting their
uploads (and the profiles' headers), auditing them, and serving stored KV. Wire-format free: the servicer translates
messages into checked records (memory_service.validation); what KV must be is memory_service.kv_checks'.

The audit: a share of new fact KV (sampled per user and completion, so that an auditor encodes the sampled facts of a
conversation window together) and every header is computed again by another worker and compared within the storage
dtype's tolerance (memory_service.kv_checks). Until then a fact's entry is served. A fact's mismatch withdraws it (the
fact is served as text), keeps both blobs aside, bars both workers from the fact and queues it for a third, and has
every entry either worker stored audited. A header needs two witnesses (_receive_header_locked): none is replaced by
one no other worker identity agrees with, and, where several worker credentials exist, none is served before a second
identity agrees with the first; until two agree the profile's memory is served as text. A worker is not told it
audits: audits are lease items (a header audit is a header_kv_wanted), and its upload is compared instead
of stored. Workers are told apart by the identity their credential binds (access.Principal.worker_identity)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from enum import Enum

import structlog

from inferscale_kv.blob import read_kv_header
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, KvKey
from inferscale_kv.shape import KvShape
from memory_service.blocking import run_blocking
from memory_service.coordination.audits import CANDIDATE_REASON, DISPUTE_REASON, Audit, KvAudits, QuarantinedBlob
from memory_service.coordination.kv_index import KvEntry, KvIndex
from memory_service.coordination.profiles import ProfileRegistry
from memory_service.coordination.work_queue import LEASE_ID, Job, KvWorkQueue
from memory_service.coordination.workers import WorkerDevice, WorkerRegistry, WorkerReport
from memory_service.errors import InvalidArgument, NotFound, NotLeaseHolder
from memory_service.fact_store import FactStore
from memory_service.kv_checks import (
    AUDIT_TOLERANCES,
    check_kv_fits_profile,
    kv_difference,
    served_content_id,
    with_content_id,
)
from memory_service.kv_store import TieredKvStore
from memory_service.models import AnnouncedProfile, KvUpload, StoredFact, StoredTurn

log = structlog.get_logger(__name__)

# Blobs FetchKv holds at once, over every call (each ~4.4 MiB at the Llama-3-8B shape, about three copies while it
# is written out): the service's memory for fetches is bounded whatever the number of streams.
FETCH_BLOBS_IN_FLIGHT = 32
# Workers must not guess which of their uploads are audited.
_AUDIT_SAMPLER = random.SystemRandom()


class AuditOutcome(Enum):
    MATCH = "match"  # the auditor's KV is the stored KV within the tolerance
    MISMATCH = "mismatch"  # it is not: the entry is withdrawn
    STALE = "stale"  # the entry changed or went away before the result came, or its inputs did (computed again)
    ABANDONED = "abandoned"  # leased too often without a result: the entry is withdrawn and computed again


@dataclass(frozen=True)
class AuditResult:
    key: KvKey
    outcome: AuditOutcome
    producer: str
    auditor: str
    difference: float  # kv_checks.kv_difference (0 when there was nothing to compare)


class HeaderOutcome(Enum):
    STORED = "stored"  # stored and served: agreed on by two worker identities, or the first of a one-witness service
    UNCHANGED = "unchanged"  # the stored header, within the tolerance (an audit of it passed, if it was one)
    WAITING = "waiting"  # kept as the announcer's candidate until another worker identity agrees (text meanwhile)
    CONFLICT = "conflict"  # differing from the stored header or another candidate: kept aside, nothing replaced
    REFUSED = "refused"  # the announcer is barred from the header, or its header differed from the stored one already


@dataclass(frozen=True)
class Announcement:
    facts_queued: int
    header: HeaderOutcome | None  # None: no header came with it
    audit: AuditResult | None  # the header's audit, when the header was one


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
    header_wanted: bool  # the worker should announce the profile's header KV (header_wanted says when)
    audits_abandoned: int  # audits given up by this call (leased too often without a result: entries withdrawn)


@dataclass(frozen=True)
class CompletionCounts:
    accepted: int = 0
    duplicates: int = 0  # KV of the fact was stored already (audit results among them)
    stale: int = 0
    audits: tuple[AuditResult, ...] = ()


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
                 work_queue: KvWorkQueue, kv_index: KvIndex, audits: KvAudits, worker_registry: WorkerRegistry,
                 lease_max_facts: int, lease_seconds: float, lease_max_seconds: float, audit_share: float,
                 header_witnesses: int = 1) -> None:
        """`lease_max_facts`, `lease_seconds`, `lease_max_seconds`: a lease's largest size, its default length and
        the longest a worker may ask for; `audit_share`: the share of new fact KV audited (0: none; headers always
        are); `header_witnesses`: the worker identities that must agree on a new profile's header before it is
        served (2 where the deployment has several worker credentials, 1 where one worker is trusted)."""
        if header_witnesses not in (1, 2):
            raise ValueError(f"header_witnesses: 1 or 2, not {header_witnesses}")
        self._fact_store = fact_store
        self._kv_store = kv_store
        self._profile_registry = profile_registry
        self._work_queue = work_queue
        self._kv_index = kv_index
        self._audits = audits
        self._worker_registry = worker_registry
        self._lease_max_facts = lease_max_facts
        self._lease_seconds = lease_seconds
        self._lease_max_seconds = lease_max_seconds
        self._audit_share = audit_share
        self._header_witnesses = header_witnesses
        self._announced: set[str] = set()  # profiles known to the registry (skip the write on the request path)
        self._fields: dict[str, dict] = {}  # the fields of announced profiles (they never change)
        self._shapes: dict[str, KvShape] = {}  # the KV layout of profiles with KV stored (it never changes)
        self._header_locks: dict[str, asyncio.Lock] = {}  # one header received at a time per profile
        self._fetch_slots = asyncio.Semaphore(FETCH_BLOBS_IN_FLIGHT)

    # ------------------------------------------------------------------ profiles

    async def announce(self, profile: AnnouncedProfile, header_kv: KvUpload | None = None,
                       announcer: str = "") -> Announcement:
        """Registers a profile and receives its header KV when given (from a worker, `announcer`: as a candidate or
        stored, confirming or disputing the stored one: _receive_header_locked); a new profile gets every stored fact
        queued. A header that does not fit the profile raises InvalidArgument before anything changes."""
        header, audit = await self._receive_header(profile, header_kv, announcer) if header_kv else (None, None)
        if profile.profile_id in self._announced:
            return Announcement(0, header, audit)
        is_new = await run_blocking(self._profile_registry.add, profile.profile_id, profile.fields)
        self._announced.add(profile.profile_id)
        if not is_new:
            return Announcement(0, header, audit)
        versions = await self._fact_store.fact_versions()
        queued = await run_blocking(self._work_queue.enqueue, [profile.profile_id], versions)
        log.info("profile_announced", profile_id=profile.profile_id, facts_queued=queued, **profile.fields)
        return Announcement(queued, header, audit)

    def profiles(self) -> dict[str, dict]:
        """profile_id -> fields, of every announced profile (blocking)."""
        return self._profile_registry.all()

    async def header_entry(self, profile_id: str) -> KvEntry | None:
        return await run_blocking(self._kv_index.header_entry, profile_id)

    async def _profile_fields(self, profile_id: str) -> dict:
        if profile_id not in self._fields:
            self._fields.update(await run_blocking(self.profiles))
        if profile_id not in self._fields:
            raise NotFound(f"profile_id: {profile_id!r} was never announced (call AnnounceProfile first)")
        return self._fields[profile_id]

    async def _require_profile(self, profile_id: str) -> None:
        if profile_id not in self._announced:
            await self._profile_fields(profile_id)

    async def _stored_shape(self, profile_id: str) -> KvShape | None:
        """The KV layout of what is stored for the profile (its header, else any fact); None while nothing is."""
        if profile_id not in self._shapes:
            entry = await self.header_entry(profile_id) or await run_blocking(self._kv_index.any_entry, profile_id)
            blob = await run_blocking(self._kv_store.get, entry.key) if entry else None
            if blob is not None:
                self._shapes[profile_id] = read_kv_header(blob).kv_shape
        return self._shapes.get(profile_id)

    async def _check_fit(self, profile_id: str, kv_dtype: str, uploads: Sequence[KvUpload], field: str) -> None:
        """Each upload must be stored as the profile's kv_dtype and laid out as the profile's stored KV (or, with
        nothing stored, as the first upload); InvalidArgument names the first that is not."""
        shape = await self._stored_shape(profile_id) or (uploads[0].shape if uploads else None)
        for index, upload in enumerate(uploads):
            check_kv_fits_profile(upload, kv_dtype, shape, field.format(index=index))

    # ------------------------------------------------------------------ headers and the audit

    async def _served(self, upload: KvUpload) -> tuple[KvUpload, list[str]]:
        """The upload as it is stored and served (kv_checks.served_content_id: renamed when KV of its fact version
        was withdrawn before), and the workers barred from that fact version."""
        barred = await run_blocking(self._audits.barred, upload.key)
        served = served_content_id(upload.key.content_id, barred)
        if served == upload.key.content_id:
            return upload, barred
        blob = await run_blocking(with_content_id, upload.blob, served)
        return dataclasses.replace(upload, key=dataclasses.replace(upload.key, content_id=served), blob=blob), barred

    async def _difference(self, stored: KvKey, stored_blob: bytes, upload: KvUpload) -> float:
        """kv_checks.kv_difference of an upload from a stored blob (an entry's, or a candidate's) kept under `stored`,
        infinite when the upload's content id is not the one that blob was computed under or its layout differs."""
        served, _ = await self._served(upload)
        if served.key != stored or upload.shape != read_kv_header(stored_blob).kv_shape:
            return math.inf
        return await run_blocking(kv_difference, stored_blob, upload.blob)

    async def _receive_header(self, profile: AnnouncedProfile, upload: KvUpload,
                              announcer: str) -> tuple[HeaderOutcome, AuditResult | None]:
        profile_id = profile.profile_id
        # Its dtype only: a header laid out otherwise than the stored one is a differing header (a conflict).
        check_kv_fits_profile(upload, str(profile.fields["kv_dtype"]), None, "header_kv")
        async with self._header_locks.setdefault(profile_id, asyncio.Lock()):
            return await self._receive_header_locked(profile_id, upload, announcer)

    async def _receive_header_locked(self, profile_id: str, upload: KvUpload,
                                     announcer: str) -> tuple[HeaderOutcome, AuditResult | None]:
        """A header is served only once `header_witnesses` worker identities agree on it (within the dtype's
        tolerance), and a stored header is never replaced by one no other identity agrees with.
        - A barred announcer, or one that disputed the stored header already, is refused before any comparison.
        - With a header stored: one that agrees confirms it (the audit of its producer's header passes). One that
          differs from a confirmed header is kept aside (a dispute; the stored one stays served). One that differs
          from an unconfirmed header withdraws it: both become candidates, and the memory is served as text.
        - With none stored: a header that agrees with another identity's candidate is stored, the candidates that
          differed bar their workers. Otherwise it is the announcer's candidate, stored at once only on a
          one-witness service while no other candidate disputes it (its audit to come)."""
        barred = await run_blocking(self._audits.barred, upload.key)
        if announcer in barred:
            return self._refused(profile_id, announcer, "barred after a header it stored or proposed was outvoted")
        entry = await self.header_entry(profile_id)
        stored = await run_blocking(self._kv_store.get, entry.key) if entry else None
        if entry is None or stored is None:
            return await self._receive_candidate(profile_id, upload, announcer)
        if announcer in await run_blocking(self._audits.disputers, entry.key):
            return self._refused(profile_id, announcer, "its header differed from the stored one already")
        pending = await run_blocking(self._audits.pending, entry.key)
        difference = await self._difference(entry.key, stored, upload)
        tolerance = AUDIT_TOLERANCES[upload.storage_dtype]
        if difference <= tolerance:
            if pending is not None and pending.producer != announcer and \
                    await run_blocking(self._audits.finish, pending):
                log.info("kv_header_confirmed", profile_id=profile_id, stored_by=entry.producer,
                         confirmed_by=announcer, difference=difference)
                return HeaderOutcome.UNCHANGED, AuditResult(entry.key, AuditOutcome.MATCH, entry.producer, announcer,
                                                            difference)
            return HeaderOutcome.UNCHANGED, None
        if pending is not None and pending.producer == announcer:
            return self._refused(profile_id, announcer, "its header differs from the one it stored, which no second "
                                 "worker has confirmed yet")
        # Withdrawing an unconfirmed header consumes its audit: a replica confirming it at once either finished it
        # first (the header is confirmed: kept) or finds it gone (this withdrawal decided).
        if pending is None or not await run_blocking(self._audits.finish, pending):
            await run_blocking(self._audits.dispute, entry.key, QuarantinedBlob(announcer, DISPUTE_REASON,
                                                                                upload.blob))
            log.warning("kv_header_conflict", profile_id=profile_id, stored_by=entry.producer, differing_from=announcer,
                        difference=difference, tolerance=tolerance,
                        action="the stored header, confirmed by a second worker, stays served; the differing one "
                               "kept aside and its worker's headers refused")
            return HeaderOutcome.CONFLICT, None
        # One identity against one: neither is served until another agrees with one of them.
        candidate = QuarantinedBlob(entry.producer, CANDIDATE_REASON, stored)
        if await run_blocking(self._kv_store.quarantine, entry.key, [], [candidate]):
            self._shapes.pop(profile_id, None)
        await self._propose_header(upload, announcer)
        log.warning("kv_header_conflict", profile_id=profile_id, stored_by=entry.producer, differing_from=announcer,
                    difference=difference, tolerance=tolerance,
                    action="the stored header had no second witness: withdrawn, both kept as candidates, the "
                           "memory served as text until another worker agrees with one")
        return HeaderOutcome.CONFLICT, AuditResult(entry.key, AuditOutcome.MISMATCH, entry.producer, announcer,
                                                   difference)

    async def _receive_candidate(self, profile_id: str, upload: KvUpload,
                                 announcer: str) -> tuple[HeaderOutcome, AuditResult | None]:
        """A header while none is stored (see _receive_header_locked). The announcer's candidate is kept before the
        others are read, so that of two replicas receiving agreeing headers at once at least one sees the other's;
        only candidates found to differ from the agreed header bar their workers."""
        tolerance = AUDIT_TOLERANCES[upload.storage_dtype]
        if self._header_witnesses == 1 and not await self._other_candidate_workers(profile_id, announcer):
            if await self._store_header(profile_id, upload, announcer, audit=True):
                return HeaderOutcome.STORED, None
            return HeaderOutcome.UNCHANGED, None  # another replica stored one meanwhile: the next lease compares
        await self._propose_header(upload, announcer)
        others = [(key, candidate) for key, candidate in await run_blocking(self._audits.header_candidates, profile_id)
                  if candidate.worker_id != announcer]
        differences = {candidate.worker_id: await self._difference(key, candidate.blob, upload)
                       for key, candidate in others}
        agreeing = sorted((difference, worker) for worker, difference in differences.items()
                          if difference <= tolerance)
        if agreeing:
            difference, witness = agreeing[0]
            wrong = sorted(worker for worker, apart in differences.items() if apart > tolerance)
            # Barred first: the header is then stored under the content id that names the new bar (_served).
            await run_blocking(self._audits.settle_header, upload.key, wrong)
            if not await self._store_header(profile_id, upload, announcer, audit=False):
                return HeaderOutcome.UNCHANGED, None  # another replica stored one meanwhile: the next lease compares
            log.info("kv_header_agreed", profile_id=profile_id, proposed_by=witness, agreed_by=announcer,
                     difference=difference, barred=wrong)
            return HeaderOutcome.STORED, AuditResult(upload.key, AuditOutcome.MATCH, witness, announcer, difference)
        if others:
            log.warning("kv_header_conflict", profile_id=profile_id, differing_from=sorted(differences),
                        announcer=announcer, action="kept as a candidate: no two workers agree yet, the memory is "
                                                    "served as text")
            return HeaderOutcome.CONFLICT, None
        log.info("kv_header_waiting", profile_id=profile_id, proposed_by=announcer,
                 action="kept as a candidate until a worker of another credential agrees; the memory is served as "
                        "text meanwhile")
        return HeaderOutcome.WAITING, None

    async def _other_candidate_workers(self, profile_id: str, worker_id: str) -> list[str]:
        return [worker for worker in await run_blocking(self._audits.header_candidate_workers, profile_id)
                if worker != worker_id]

    async def _propose_header(self, upload: KvUpload, announcer: str) -> None:
        """Keeps the header as the announcer's candidate, as it would be stored (_served): candidates and stored
        headers compare alike."""
        served, _ = await self._served(upload)
        await run_blocking(self._audits.propose_header, served.key,
                           QuarantinedBlob(announcer, CANDIDATE_REASON, served.blob))

    async def _store_header(self, profile_id: str, upload: KvUpload, producer: str, audit: bool) -> bool:
        """Stores the header as `producer`'s (with `audit`: unconfirmed, its audit to come); False if one is stored
        already."""
        served, _ = await self._served(upload)
        if not await run_blocking(self._kv_store.put, served.key, served.blob, served.token_ids, None, producer,
                                  audit):
            return False
        self._shapes[profile_id] = upload.shape  # the header's layout is the profile's
        return True

    @staticmethod
    def _refused(profile_id: str, announcer: str, reason: str) -> tuple[HeaderOutcome, AuditResult | None]:
        log.warning("kv_header_refused", profile_id=profile_id, worker_id=announcer, reason=reason)
        return HeaderOutcome.REFUSED, None

    async def header_wanted(self, profile_id: str, worker_id: str) -> bool:
        """Whether to ask `worker_id` for the profile's header (unless it is barred from it): none is stored and the
        worker has no candidate yet, or the stored one waits for a second identity, neither its producer nor a worker
        whose header differed from it."""
        header_version = KvKey(profile_id, HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, "")
        if worker_id in await run_blocking(self._audits.barred, header_version):
            return False
        entry = await self.header_entry(profile_id)
        if entry is None:
            return worker_id not in await run_blocking(self._audits.header_candidate_workers, profile_id)
        pending = await run_blocking(self._audits.pending, entry.key)
        return pending is not None and pending.producer != worker_id and \
            worker_id not in await run_blocking(self._audits.disputers, entry.key)

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

    async def lease(self, request: LeaseRequest, identity: str) -> KvWorkLease:
        """Records the worker's report and leases it facts of the profile, with the turns they were said in: audits
        it may do first (audited facts look like any other), then queued facts. Returns the audits given up too.
        `identity`: the worker as audits tell workers apart (its credential, Principal.worker_identity): it is not
        leased audits of what that identity produced, nor work it is barred from. A lease longer than the service's
        maximum raises InvalidArgument before anything changes."""
        if request.lease_seconds > self._lease_max_seconds:
            raise InvalidArgument("lease_seconds", f"{request.lease_seconds} is longer than the service's longest "
                                  f"lease, {self._lease_max_seconds} seconds (--kv-lease-max-seconds)")
        await self._require_profile(request.profile_id)
        await run_blocking(self._worker_registry.record, WorkerReport(
            request.worker_id, request.profile_id, time.time(), request.facts_per_second, request.device))
        max_facts = min(request.max_facts or self._lease_max_facts, self._lease_max_facts)
        lease_seconds = request.lease_seconds or self._lease_seconds
        lease_id = uuid.uuid4().hex
        abandoned = await run_blocking(self._give_up_audits, request.profile_id)
        audits = await run_blocking(self._audits.lease, request.profile_id, identity, max_facts, lease_id,
                                    time.time() + lease_seconds)
        leased = await run_blocking(self._work_queue.lease, request.profile_id, max_facts - len(audits),
                                    lease_seconds, identity, lease_id)
        jobs = [Job(request.profile_id, a.key.user_id, a.key.fact_id, a.key.version) for a in audits] + leased.jobs
        if jobs:
            await run_blocking(self._work_queue.record_holder, lease_id, identity, leased.expires_at)
        by_user: dict[str, list[Job]] = {}
        for job in jobs:
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
        header_wanted = await self.header_wanted(request.profile_id, identity)
        return KvWorkLease(lease_id if facts else "", leased.expires_at, facts, turns_by_user, header_wanted,
                           abandoned)

    def _give_up_audits(self, profile_id: str) -> int:
        """Gives up the profile's audits that no auditor finished (KvAudits.abandoned): an entry that could not be
        audited is withdrawn (served as text) and its fact computed again, nobody barred; returns how many (blocking).
        A failure part-way leaves the rest for the next lease."""
        abandoned = self._audits.abandoned(profile_id)
        for audit in abandoned:
            key = audit.key
            if not self._kv_store.quarantine(key, [], []):
                self._audits.finish(audit)  # its entry was replaced or dropped meanwhile
                continue
            log.warning("kv_audit_abandoned", profile_id=key.profile_id, user_id=key.user_id, fact_id=key.fact_id,
                        version=key.version, producer=audit.producer, attempts=self._audits.max_attempts,
                        action="withdrawn (served as text) and computed again, nobody barred")
        return len(abandoned)

    async def complete(self, profile_id: str, lease_id: str, uploads: Sequence[KvUpload],
                       failures: Sequence[tuple[Job, str]], worker_id: str) -> CompletionCounts:
        """Stores uploads that their lease still covers (same version, same lease, in the transaction that records
        them), as `worker_id`'s; a fact deleted, changed or re-leased since counts as stale and nothing of it is
        stored. An upload for an audit the lease holds is compared with the stored KV instead. A lease that was not
        given to `worker_id` (another worker's, or never issued) raises NotLeaseHolder, and uploads not stored as the
        profile's kv_dtype, or laid out otherwise than its stored KV, raise InvalidArgument, before anything is
        stored. Failures return their jobs (and audits) to the queue (or mark them failed)."""
        if not LEASE_ID.fullmatch(lease_id) or await run_blocking(self._work_queue.holder, lease_id) != worker_id:
            raise NotLeaseHolder(f"lease_id: not a lease held by worker {worker_id!r} (a lease is completed only by "
                                 "the worker identity it was given to)")
        fields = await self._profile_fields(profile_id)
        await self._check_fit(profile_id, str(fields["kv_dtype"]), uploads, "results[{index}].blob")
        accepted = duplicates = stale = 0
        audited: list[AuditResult] = []
        sampled: dict[str, bool] = {}  # per user: whether this completion's KV of the user is audited
        for upload in uploads:
            key = upload.key
            audit = await run_blocking(self._audits.held, profile_id, key.user_id, key.fact_id, key.version, lease_id)
            if audit is not None:
                audited.append(await self._compare(audit, upload, worker_id))
                duplicates += 1
                continue
            if key.user_id not in sampled:
                sampled[key.user_id] = self._audit_share > 0 and _AUDIT_SAMPLER.random() < self._audit_share
            served, _ = await self._served(upload)
            if await run_blocking(self._kv_store.put, served.key, served.blob, served.token_ids, lease_id, worker_id,
                                  sampled[key.user_id]):
                accepted += 1
                self._shapes.setdefault(profile_id, upload.shape)
            elif (entry := self._kv_index.entry(profile_id, key.user_id, key.fact_id)) and entry.key == served.key:
                duplicates += 1
            else:
                stale += 1
        for job, error in failures:
            audit = await run_blocking(self._audits.held, profile_id, job.user_id, job.fact_id, job.version, lease_id)
            if audit is not None:
                await run_blocking(self._audits.release, audit, lease_id)
            else:
                await run_blocking(self._work_queue.fail, job, lease_id, error)
        return CompletionCounts(accepted, duplicates, stale, tuple(audited))

    async def _compare(self, audit: Audit, upload: KvUpload, auditor: str) -> AuditResult:
        """An audit's result: the auditor's upload against the entry it audits (withdrawn when they differ; when the
        upload was computed from other inputs, e.g. an edited turn, the audit is stale and the fact computed again)."""
        key = audit.key
        entry = await run_blocking(self._kv_index.entry, key.profile_id, key.user_id, key.fact_id)
        stored = await run_blocking(self._kv_store.get, key) if entry is not None and entry.key == key else None
        if entry is None or stored is None:
            await run_blocking(self._audits.finish, audit)
            return AuditResult(key, AuditOutcome.STALE, audit.producer, auditor, 0.0)
        served, _ = await self._served(upload)
        if served.key != entry.key:
            # Computed from other inputs than the entry (e.g. a turn of its window was rewritten since): nothing to
            # compare, nobody to blame; the entry is computed again from the current inputs.
            await run_blocking(self._kv_store.quarantine, key, [], [])
            log.info("kv_audit_stale", profile_id=key.profile_id, user_id=key.user_id, fact_id=key.fact_id,
                     version=key.version, producer=audit.producer, auditor=auditor,
                     action="its inputs changed: computed again, nobody barred")
            return AuditResult(key, AuditOutcome.STALE, audit.producer, auditor, 0.0)
        difference = await run_blocking(kv_difference, stored, upload.blob)
        tolerance = AUDIT_TOLERANCES[upload.storage_dtype]
        if difference <= tolerance:
            await run_blocking(self._audits.finish, audit)
            return AuditResult(key, AuditOutcome.MATCH, audit.producer, auditor, difference)
        kept = [QuarantinedBlob(audit.producer, "audit mismatch: the stored KV", stored),
                QuarantinedBlob(auditor, "audit mismatch: the auditor's KV", upload.blob)]
        if not await run_blocking(self._kv_store.quarantine, key, [audit.producer, auditor], kept):
            return AuditResult(key, AuditOutcome.STALE, audit.producer, auditor, difference)
        escalated = await run_blocking(self._audits.escalate, key.profile_id, [audit.producer, auditor])
        log.warning("kv_audit_mismatch", profile_id=key.profile_id, user_id=key.user_id, fact_id=key.fact_id,
                    version=key.version, producer=audit.producer, auditor=auditor, difference=difference,
                    tolerance=tolerance, escalated_audits=escalated,
                    action="withdrawn (served as text) and queued for a third worker; both kept aside")
        return AuditResult(key, AuditOutcome.MISMATCH, audit.producer, auditor, difference)

    # ------------------------------------------------------------------ serving

    async def serving_entries(self, profile_id: str, user_id: str,
                              facts: Sequence[StoredFact]) -> tuple[dict[str, KvEntry], KvEntry | None]:
        """Stored KV of the current versions of `facts`, and the profile's header entry (KvIndex.serving_entries);
        facts lacking KV (and not queued) get queued."""
        return await run_blocking(self._serving_entries_blocking, profile_id, user_id, facts)

    def _serving_entries_blocking(self, profile_id: str, user_id: str,
                                  facts: Sequence[StoredFact]) -> tuple[dict[str, KvEntry], KvEntry | None]:
        fact_ids = [f.fact_id for f in facts]
        entries, header = self._kv_index.serving_entries(profile_id, user_id, fact_ids)
        versions = {f.fact_id: f.version for f in facts}
        current = {fid: e for fid, e in entries.items() if versions[fid] == e.key.version}
        lacking = [f for f in facts if f.fact_id not in current]
        jobs = self._work_queue.job_versions(profile_id, user_id, [f.fact_id for f in lacking])
        missing = [(user_id, f.fact_id, f.version) for f in lacking if jobs.get(f.fact_id) != f.version]
        if missing:
            self._work_queue.enqueue([profile_id], missing)
        return current, header

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

    def audits_waiting(self) -> int:
        """Stored KV waiting for an audit (blocking)."""
        return self._audits.waiting()

    def profiles_awaiting_header(self) -> int:
        """Profiles whose memory header waits for a second worker identity (served as text meanwhile; blocking)."""
        return self._audits.awaiting_header()

    def recent_workers(self, seen_within_s: float) -> list[WorkerReport]:
        """Workers that leased within the last `seen_within_s` seconds, most recent first (blocking)."""
        return self._worker_registry.recent(seen_within_s)
