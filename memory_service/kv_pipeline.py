"""The KV pipeline: which facts need KV for which profile, leasing that work to precompute workers,
accepting their uploads, and serving stored KV. Wire-format free: the servicer translates messages."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from inferscale_kv.blob import CorruptKvBlob, KvBlobHeader, read_kv_header
from inferscale_kv.kv_key import KvKey, header_key
from memory_service.blocking import run_blocking
from memory_service.errors import InvalidArgument, NotFound
from memory_service.coordination import Job, KvEntry, QueueCounts
from memory_service.kv_store import TieredKvStore
from memory_service.models import StoredFact, StoredTurn
from memory_service.store import FactStore

log = structlog.get_logger(__name__)
_CONTENT_ID = re.compile(r"[0-9a-f]{32}")


def _blob_header(blob: bytes, field: str) -> KvBlobHeader:
    try:
        header = read_kv_header(blob)
    except CorruptKvBlob as exc:
        raise InvalidArgument(field, str(exc)) from None
    if not _CONTENT_ID.fullmatch(header.content_id):
        raise InvalidArgument(field, "content_id must be 32 lowercase hex digits (inferscale_kv.kv_key.content_id)")
    return header


@dataclass(frozen=True)
class Lease:
    lease_id: str
    expires_at: float
    facts: list[StoredFact]
    turns_by_user: dict[str, list[StoredTurn]]


@dataclass(frozen=True)
class Upload:
    user_id: str
    fact_id: str
    version: int
    blob: bytes


@dataclass(frozen=True)
class CompletionCounts:
    accepted: int = 0
    duplicates: int = 0
    stale: int = 0


class KvPipeline:
    def __init__(self, facts: FactStore, kv: TieredKvStore) -> None:
        self.facts = facts
        self.kv = kv
        self._announced: set[str] = set()  # profiles known to the index (skip the write on the request path)
        self._staging: set[asyncio.Task] = set()  # background promotions started by RetrieveAndStage

    @property
    def index(self):
        return self.kv.index

    async def announce(self, profile_id: str, spec: dict, header_blob: bytes = b"") -> int:
        """Registers a profile (and stores its header KV when given); a new profile gets every stored fact
        queued. Returns facts queued."""
        if header_blob:
            await self._store_header(profile_id, header_blob)
        if profile_id in self._announced:
            return 0
        is_new = await run_blocking(self.index.add_profile, profile_id, spec)
        self._announced.add(profile_id)
        if not is_new:
            return 0
        versions = await self.facts.fact_versions()
        queued = await run_blocking(self.index.enqueue, [profile_id], versions)
        log.info("profile_announced", profile_id=profile_id, facts_queued=queued, **spec)
        return queued

    async def _store_header(self, profile_id: str, blob: bytes) -> None:
        header = _blob_header(blob, "header_kv")
        expected = header_key(profile_id, header.token_ids)
        if header.key != expected:
            raise InvalidArgument("header_kv", f"must name {expected} (the profile's header, encoded behind nothing)")
        if await self.header_entry(profile_id) is None:
            await run_blocking(self.kv.put, expected, blob, header.token_ids, None)

    async def header_entry(self, profile_id: str) -> KvEntry | None:
        return await run_blocking(self.index.header_entry, profile_id)

    async def reconcile(self) -> int:
        """After a restart: disk and index agree, and every fact lacking KV for a profile is queued. Not with a
        shared store: other replicas write while this one starts, and a scan could take their new entries for
        stale ones (missing KV is queued by RetrieveAndStage anyway)."""
        if self.index.shared:
            return 0
        await run_blocking(self.kv.reconcile)
        current = {(user, fact): version for user, fact, version in await self.facts.fact_versions()}
        covered = {(k.profile_id, k.user_id, k.fact_id, k.version)
                   for k in [*self.index.all_entry_keys(), *self.index.all_jobs()]}
        stale = [k for k in self.index.all_entry_keys()
                 if not k.is_header and current.get((k.user_id, k.fact_id)) != k.version]
        await run_blocking(self.kv.forget_entries, stale)
        queued = 0
        for profile_id in self.index.profiles():
            missing = [(u, f, v) for (u, f), v in current.items() if (profile_id, u, f, v) not in covered]
            queued += self.index.enqueue([profile_id], missing)
        if queued or stale:
            log.info("kv_queue_reconciled", queued=queued, stale_entries=len(stale))
        return queued

    async def facts_changed(self, user_id: str, changed: Sequence[tuple[str, int]]) -> None:
        """Created or updated facts: drop KV of older versions, queue the new version for every profile."""
        if not changed:
            return
        await run_blocking(self.kv.forget, user_id, [fact_id for fact_id, _ in changed])
        profiles = list(await run_blocking(self.index.profiles))
        await run_blocking(self.index.enqueue, profiles, [(user_id, f, v) for f, v in changed])

    async def facts_deleted(self, user_id: str, fact_ids: Sequence[str] | None) -> None:
        """Deletes every KV blob and queued job of the facts (all of the user's when None)."""
        await run_blocking(self.kv.forget, user_id, fact_ids)

    async def _require_profile(self, profile_id: str) -> None:
        if profile_id not in self._announced and profile_id not in await run_blocking(self.index.profiles):
            raise NotFound(f"profile_id: {profile_id!r} was never announced (call AnnounceProfile first)")

    async def lease(self, profile_id: str, max_facts: int, lease_seconds: float) -> Lease:
        await self._require_profile(profile_id)
        lease_id, expires, keys = await run_blocking(self.index.lease, profile_id, max_facts, lease_seconds)
        by_user: dict[str, list[Job]] = {}
        for key in keys:
            by_user.setdefault(key.user_id, []).append(key)
        facts: list[StoredFact] = []
        turns_by_user: dict[str, list[StoredTurn]] = {}
        for user_id, user_keys in by_user.items():
            stored = await self.facts.facts_by_ids(user_id, [key.fact_id for key in user_keys])
            user_facts = [stored[k.fact_id] for k in user_keys if k.fact_id in stored
                          and stored[k.fact_id].version == k.version]
            facts.extend(user_facts)
            sources = {fact.source_turn_id for fact in user_facts if fact.source_turn_id}
            if sources:
                turns = await self.facts.turns_of_user(user_id)
                last = max((i for i, turn in enumerate(turns) if turn.turn_id in sources), default=-1)
                turns_by_user[user_id] = turns[: last + 1]
        return Lease(lease_id if facts else "", expires, facts, turns_by_user)

    async def complete(self, profile_id: str, lease_id: str, uploads: Sequence[Upload],
                       failures: Sequence[tuple[Job, str]]) -> CompletionCounts:
        """Stores uploads that their lease still covers (same version, same lease, in the transaction that records
        them); a fact deleted, changed or re-leased since counts as stale and nothing of it is stored."""
        await self._require_profile(profile_id)
        accepted = duplicates = stale = 0
        for index, upload in enumerate(uploads):
            header = _blob_header(upload.blob, f"results[{index}].blob")
            if (header.profile_id, header.user_id, header.fact_id, header.version) != (
                    profile_id, upload.user_id, upload.fact_id, upload.version) or header.key.is_header:
                raise InvalidArgument(f"results[{index}].blob", "header names another profile, fact or version")
            if await run_blocking(self.kv.put, header.key, upload.blob, header.token_ids, lease_id):
                accepted += 1
            elif (entry := self.index.entry(profile_id, upload.user_id, upload.fact_id)) and entry.key == header.key:
                duplicates += 1
            else:
                stale += 1
        for job, error in failures:
            await run_blocking(self.index.fail, job, lease_id, error)
        return CompletionCounts(accepted, duplicates, stale)

    async def kv_bytes_with_user_prefix(self, prefix: str) -> int:
        return await run_blocking(self.index.kv_bytes_with_user_prefix, prefix)

    async def entries(self, profile_id: str, user_id: str, facts: Sequence[StoredFact]) -> dict[str, KvEntry]:
        """Stored KV of the current versions of `facts`; facts lacking it (and not queued) get queued."""
        return await run_blocking(self._entries_blocking, profile_id, user_id, facts)

    def _entries_blocking(self, profile_id: str, user_id: str, facts: Sequence[StoredFact]) -> dict[str, KvEntry]:
        fact_ids = [f.fact_id for f in facts]
        entries = self.index.entries(profile_id, user_id, fact_ids)
        versions = {f.fact_id: f.version for f in facts}
        current = {fid: e for fid, e in entries.items() if versions[fid] == e.key.version}
        lacking = [f for f in facts if f.fact_id not in current]
        jobs = self.index.job_versions(profile_id, user_id, [f.fact_id for f in lacking])
        missing = [(user_id, f.fact_id, f.version) for f in lacking if jobs.get(f.fact_id) != f.version]
        if missing:
            self.index.enqueue([profile_id], missing)
        return current

    async def fetch(self, key: KvKey) -> bytes | None:
        return await run_blocking(self.kv.get, key)

    def stage(self, keys: Sequence[KvKey]) -> None:
        """Promotes the entries into the memory tiers in the background (TieredKvStore.promote)."""
        task = asyncio.get_running_loop().create_task(run_blocking(self._read_all, list(keys)))
        self._staging.add(task)
        task.add_done_callback(self._staging.discard)

    def _read_all(self, keys: list[KvKey]) -> None:
        for key in keys:
            self.kv.promote(key)

    def counts(self, profile_id: str, user_id: str = "") -> QueueCounts:
        return self.index.counts(profile_id, user_id)
