"""The KV index (table `kv_entries`): which fact KV is stored, under its full key (content id included), with its
token ids, size and the worker that produced it. What the index lists is what the KV tiers may serve
(memory_service.kv_store). Recording an entry takes its job off the work queue (and schedules its audit when asked),
forgetting facts drops their jobs and audits, and quarantining an entry unlists it, keeps its blobs aside and queues
its fact again for other workers, each in one transaction."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, KvKey
from memory_service.coordination.audits import KvAudits, QuarantinedBlob
from memory_service.coordination.work_queue import KvWorkQueue, facts_condition
from memory_service.sql import Database


@dataclass(frozen=True)
class KvEntry:
    key: KvKey
    token_ids: list[int]
    nbytes: int
    producer: str  # the worker that uploaded it ("" for entries stored before producers were recorded)


@dataclass(frozen=True)
class StoredCounts:
    """A profile's stored fact KV (the header not counted)."""

    done: int
    kv_bytes: int


class KvIndex:
    def __init__(self, database: Database, work_queue: KvWorkQueue, audits: KvAudits) -> None:
        self._database = database
        self._work_queue = work_queue
        self._audits = audits

    def record_stored(self, key: KvKey, token_ids: Sequence[int], nbytes: int, lease_id: str | None,
                      producer: str = "", audit: bool = False) -> bool:
        """Marks KV stored for key, uploaded by `producer`, in one transaction with taking its job off the queue and
        scheduling its audit (`audit`) or dropping one of the fact's earlier KV: with a `lease_id`, only while that
        lease still holds the job for key's version (else nothing changes and False is returned); without one, a
        profile's header only while none is recorded (else False: the caller compares with the one that is), other
        KV unconditionally."""
        with self._database.transaction() as tx:
            if lease_id is not None and not self._work_queue.take_job(tx, key, lease_id):
                return False  # nothing changed: the lease no longer holds the job
            on_conflict = "NOTHING" if lease_id is None and key.is_header else (
                "UPDATE SET version = excluded.version, content_id = excluded.content_id, token_ids = "
                "excluded.token_ids, nbytes = excluded.nbytes, stored_at = excluded.stored_at, "
                "producer = excluded.producer")
            if not tx.run("INSERT INTO kv_entries (profile_id, user_id, fact_id, version, content_id, token_ids, "
                          "nbytes, stored_at, producer) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                          f"ON CONFLICT (profile_id, user_id, fact_id) DO {on_conflict}",
                          (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id,
                           json.dumps(list(token_ids)), nbytes, time.time(), producer)):
                return False
            if audit:
                self._audits.schedule(tx, key, producer)
            else:
                self._audits.unschedule(tx, key)
        return True

    def quarantine(self, key: KvKey, exclude: Sequence[str], kept: Sequence[QuarantinedBlob]) -> bool:
        """Unlists the entry stored under exactly `key` (False, and nothing changed, if it is not listed anymore),
        keeps `kept` aside, bars the `exclude` workers from the fact version, and queues the fact again (not the
        header: a worker is asked for it), in one transaction."""
        with self._database.transaction() as tx:
            if not tx.run("DELETE FROM kv_entries WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
                          "AND content_id = ?", (key.profile_id, key.user_id, key.fact_id, key.version,
                                                 key.content_id)):
                return False
            self._audits.unschedule(tx, key)
            self._audits.keep_aside(tx, key, kept)
            self._audits.exclude(tx, key, exclude)
            if not key.is_header:
                self._work_queue.requeue(tx, key)
        return True

    def entry(self, profile_id: str, user_id: str, fact_id: str) -> KvEntry | None:
        return self.entries(profile_id, user_id, [fact_id]).get(fact_id)

    def header_entry(self, profile_id: str) -> KvEntry | None:
        """The profile's memory header KV, if stored."""
        return self.entry(profile_id, HEADER_OWNER, HEADER_FACT_ID)

    def entries(self, profile_id: str, user_id: str, fact_ids: Sequence[str]) -> dict[str, KvEntry]:
        """fact_id -> entry, for those of `fact_ids` with KV stored (at whichever version)."""
        if not fact_ids:
            return {}
        placeholders = ",".join("?" * len(fact_ids))
        rows = self._database.query(
            f"SELECT fact_id, version, content_id, token_ids, nbytes, producer FROM kv_entries WHERE profile_id = ? "
            f"AND user_id = ? AND fact_id IN ({placeholders})", (profile_id, user_id, *fact_ids))
        return {fact: KvEntry(KvKey(profile_id, user_id, fact, version, content), json.loads(tokens), nbytes,
                              producer)
                for fact, version, content, tokens, nbytes, producer in rows}

    def any_entry(self, profile_id: str) -> KvEntry | None:
        """One stored fact entry of the profile, if any."""
        rows = self._database.query("SELECT user_id, fact_id FROM kv_entries WHERE profile_id = ? AND user_id != ? "
                                    "LIMIT 1", (profile_id, HEADER_OWNER))
        return self.entry(profile_id, *rows[0]) if rows else None

    def all_entry_keys(self) -> list[KvKey]:
        return [KvKey(*row) for row in self._database.query(
            "SELECT profile_id, user_id, fact_id, version, content_id FROM kv_entries")]

    def forget_entry(self, key: KvKey) -> bool:
        """Drops the entry (and its audit) if it is listed under exactly `key`; whether it was."""
        with self._database.transaction() as tx:
            if not tx.run("DELETE FROM kv_entries WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
                          "AND content_id = ?",
                          (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id)):
                return False
            self._audits.unschedule(tx, key)
            return True

    def forget_facts(self, user_id: str, fact_ids: Sequence[str] | None) -> list[KvKey]:
        """Drops jobs, entries, audits, bars and quarantined KV of the given facts (all of the user's when None), for
        every profile, in one transaction; returns the stored keys that were dropped."""
        condition, params = facts_condition(user_id, fact_ids)
        with self._database.transaction() as tx:
            # Jobs first: under PostgreSQL's READ COMMITTED this waits for a completion that holds one of them, and
            # the entries are then read afresh, the completion's included (entries first could miss it).
            self._work_queue.drop_jobs(tx, user_id, fact_ids)
            self._audits.drop_facts(tx, user_id, fact_ids)
            return [KvKey(*row) for row in tx.rows(
                f"DELETE FROM kv_entries WHERE {condition} RETURNING profile_id, user_id, fact_id, version, content_id",
                params)]

    def kv_bytes_with_user_prefix(self, prefix: str) -> int:
        """Bytes of stored fact KV, over every profile, of the users whose id starts with `prefix`."""
        return self._database.query("SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM kv_entries "
                                    "WHERE substr(user_id, 1, ?) = ? AND user_id != ?",
                                    [len(prefix), prefix, HEADER_OWNER])[0][0]

    def stored(self, profile_id: str, user_id: str = "") -> StoredCounts:
        """The profile's stored fact KV (of one user, or of all users)."""
        user_filter, params = (" AND user_id = ?", [user_id]) if user_id else ("", [])
        done, kv_bytes = self._database.query(
            "SELECT count(*), CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM kv_entries WHERE profile_id = ? "
            f"AND user_id != ?{user_filter}", [profile_id, HEADER_OWNER, *params])[0]
        return StoredCounts(done=done, kv_bytes=kv_bytes)
