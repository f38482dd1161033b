"""The KV index (table `kv_entries`): which fact KV is stored, under its full key (content id included), with its
token ids and size. What the index lists is what the KV tiers may serve (memory_service.kv_store). Recording an
entry takes its job off the work queue, and forgetting facts drops their jobs, each in the same transaction."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, KvKey
from memory_service.coordination.work_queue import KvWorkQueue, facts_condition
from memory_service.sql import Database


@dataclass(frozen=True)
class KvEntry:
    key: KvKey
    token_ids: list[int]
    nbytes: int


@dataclass(frozen=True)
class StoredCounts:
    """A profile's stored fact KV (the header not counted)."""

    done: int
    kv_bytes: int


class KvIndex:
    def __init__(self, database: Database, work_queue: KvWorkQueue) -> None:
        self._database = database
        self._work_queue = work_queue

    def record_stored(self, key: KvKey, token_ids: Sequence[int], nbytes: int, lease_id: str | None) -> bool:
        """Marks KV stored for key, in one transaction with taking its job off the queue: with a `lease_id`, only
        while that lease still holds the job for key's version (else nothing changes and False is returned);
        without one (the profile's header), unconditionally."""
        with self._database.transaction() as tx:
            if lease_id is not None and not self._work_queue.take_job(tx, key, lease_id):
                return False  # nothing changed: the lease no longer holds the job
            tx.run("INSERT INTO kv_entries VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (profile_id, user_id, fact_id) "
                   "DO UPDATE SET version = excluded.version, content_id = excluded.content_id, "
                   "token_ids = excluded.token_ids, nbytes = excluded.nbytes, stored_at = excluded.stored_at",
                   (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id,
                    json.dumps(list(token_ids)), nbytes, time.time()))
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
            f"SELECT fact_id, version, content_id, token_ids, nbytes FROM kv_entries WHERE profile_id = ? "
            f"AND user_id = ? AND fact_id IN ({placeholders})", (profile_id, user_id, *fact_ids))
        return {fact: KvEntry(KvKey(profile_id, user_id, fact, version, content), json.loads(tokens), nbytes)
                for fact, version, content, tokens, nbytes in rows}

    def all_entry_keys(self) -> list[KvKey]:
        return [KvKey(*row) for row in self._database.query(
            "SELECT profile_id, user_id, fact_id, version, content_id FROM kv_entries")]

    def forget_entry(self, key: KvKey) -> bool:
        """Drops the entry if it is listed under exactly `key`; whether it was."""
        with self._database.transaction() as tx:
            return tx.run("DELETE FROM kv_entries WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
                   "AND content_id = ?", (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id)) == 1

    def forget_facts(self, user_id: str, fact_ids: Sequence[str] | None) -> list[KvKey]:
        """Drops jobs and entries of the given facts (all of the user's when None), for every profile, in one
        transaction; returns the stored keys that were dropped."""
        condition, params = facts_condition(user_id, fact_ids)
        with self._database.transaction() as tx:
            # Jobs first: under PostgreSQL's READ COMMITTED this waits for a completion that holds one of them, and
            # the entries are then read afresh, the completion's included (entries first could miss it).
            self._work_queue.drop_jobs(tx, user_id, fact_ids)
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
