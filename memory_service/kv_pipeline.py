"""The KV pipeline: which facts need KV for which profile, leasing that work to precompute workers,
accepting their uploads, and serving stored KV. Wire-format free: the servicer translates messages."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from inferscale_kv.blob import CorruptKvBlob, read_kv_header
from memory_service.errors import InvalidArgument, NotFound
from memory_service.kv_index import KvEntry, QueueCounts
from memory_service.kv_store import TieredKvStore
from memory_service.kv_tiers import KvKey
from memory_service.models import StoredFact, StoredTurn
from memory_service.store import FactStore

log = structlog.get_logger(__name__)

# The profile's memory header KV is stored like a fact of this reserved user (outside the id alphabet).
HEADER_USER, HEADER_FACT, HEADER_VERSION = "_profile", "header", 1


def header_key(profile_id: str) -> KvKey:
    return KvKey(profile_id, HEADER_USER, HEADER_FACT, HEADER_VERSION)


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
        is_new = await asyncio.to_thread(self.index.add_profile, profile_id, spec)
        self._announced.add(profile_id)
        if not is_new:
            return 0
        versions = await self.facts.fact_versions()
        queued = await asyncio.to_thread(self.index.enqueue, [profile_id], versions)
        log.info("profile_announced", profile_id=profile_id, facts_queued=queued, **spec)
        return queued

    async def _store_header(self, profile_id: str, blob: bytes) -> None:
        key = header_key(profile_id)
        try:
            header = read_kv_header(blob)
        except CorruptKvBlob as exc:
            raise InvalidArgument("header_kv", str(exc)) from None
        if (header.profile_id, header.user_id, header.fact_id, header.version) != (
                profile_id, key.user_id, key.fact_id, key.version):
            raise InvalidArgument("header_kv", f"must name profile {profile_id}, user {HEADER_USER!r}, "
                                               f"fact {HEADER_FACT!r}, version {HEADER_VERSION}")
        if self.index.stored_version(profile_id, key.user_id, key.fact_id) is None:
            await asyncio.to_thread(self.kv.put, key, blob, header.token_ids)

    async def reconcile(self) -> int:
        """After a restart: disk and index agree, and every fact lacking KV for a profile is queued."""
        await asyncio.to_thread(self.kv.reconcile)
        current = {(user, fact): version for user, fact, version in await self.facts.fact_versions()}
        covered = {(k.profile_id, k.user_id, k.fact_id, k.version)
                   for k in [*self.index.all_entry_keys(), *self.index.all_job_keys()]}
        stale = [k for k in self.index.all_entry_keys()
                 if k.user_id != HEADER_USER and current.get((k.user_id, k.fact_id)) != k.version]
        for key in stale:
            self.index.forget_entry(key)
        self.kv.remove(stale)
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
        fact_ids = [fact_id for fact_id, _ in changed]
        dropped = await asyncio.to_thread(self.index.forget_facts, user_id, fact_ids)
        await asyncio.to_thread(self.kv.remove, dropped)
        profiles = list(self.index.profiles())
        await asyncio.to_thread(self.index.enqueue, profiles, [(user_id, f, v) for f, v in changed])

    async def facts_deleted(self, user_id: str, fact_ids: Sequence[str] | None) -> None:
        """Deletes every KV blob and queued job of the facts (all of the user's when None)."""
        dropped = await asyncio.to_thread(self.index.forget_facts, user_id, fact_ids)
        await asyncio.to_thread(self.kv.remove, dropped)

    def _require_profile(self, profile_id: str) -> None:
        if profile_id not in self.index.profiles():
            raise NotFound(f"profile_id: {profile_id!r} was never announced (call AnnounceProfile first)")

    async def lease(self, profile_id: str, max_facts: int, lease_seconds: float) -> Lease:
        self._require_profile(profile_id)
        lease_id, expires, keys = await asyncio.to_thread(self.index.lease, profile_id, max_facts, lease_seconds)
        by_user: dict[str, list[KvKey]] = {}
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

    async def complete(self, profile_id: str, uploads: Sequence[Upload],
                       failures: Sequence[tuple[KvKey, str]]) -> CompletionCounts:
        self._require_profile(profile_id)
        accepted = duplicates = stale = 0
        for index, upload in enumerate(uploads):
            key = KvKey(profile_id, upload.user_id, upload.fact_id, upload.version)
            try:
                header = read_kv_header(upload.blob)
            except CorruptKvBlob as exc:
                raise InvalidArgument(f"results[{index}].blob", str(exc)) from None
            if (header.profile_id, header.user_id, header.fact_id, header.version) != (
                    profile_id, upload.user_id, upload.fact_id, upload.version):
                raise InvalidArgument(f"results[{index}].blob", "header names another profile, fact or version")
            if self.index.job_version(profile_id, upload.user_id, upload.fact_id) == upload.version:
                await asyncio.to_thread(self.kv.put, key, upload.blob, header.token_ids)
                accepted += 1
            elif self.index.stored_version(profile_id, upload.user_id, upload.fact_id) == upload.version:
                duplicates += 1
            else:
                stale += 1
        for key, error in failures:
            await asyncio.to_thread(self.index.fail, key, error)
        return CompletionCounts(accepted, duplicates, stale)

    async def kv_bytes_with_user_prefix(self, prefix: str) -> int:
        return await asyncio.to_thread(self.index.kv_bytes_with_user_prefix, prefix)

    async def entries(self, profile_id: str, user_id: str, facts: Sequence[StoredFact]) -> dict[str, KvEntry]:
        """Stored KV of the current versions of `facts`; facts lacking it (and not queued) get queued."""
        return await asyncio.to_thread(self._entries_blocking, profile_id, user_id, facts)

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
        return await asyncio.to_thread(self.kv.get, key)

    def stage(self, keys: Sequence[KvKey]) -> None:
        """Promotes the entries into the memory tiers in the background (TieredKvStore.promote)."""
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._read_all, list(keys)))
        self._staging.add(task)
        task.add_done_callback(self._staging.discard)

    def _read_all(self, keys: list[KvKey]) -> None:
        for key in keys:
            self.kv.promote(key)

    def counts(self, profile_id: str, user_id: str = "") -> QueueCounts:
        return self.index.counts(profile_id, user_id)
