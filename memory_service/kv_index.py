"""Durable bookkeeping of the KV pipeline in SQLite: announced profiles, the work queue with leases, and
which KV is stored (its full key, content id included, and token ids). Thread-safe; every call is one
transaction, committed before it returns."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, KvKey

# Version 2: entries carry their content id. Older bookkeeping is dropped at open (its blobs then have no entry:
# reconcile deletes them and queues every fact again).
_SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS profiles (
    profile_id TEXT PRIMARY KEY, spec TEXT NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    profile_id TEXT NOT NULL, user_id TEXT NOT NULL, fact_id TEXT NOT NULL, version INTEGER NOT NULL,
    state TEXT NOT NULL, lease_id TEXT, lease_expires REAL, attempts INTEGER NOT NULL DEFAULT 0,
    enqueued_at REAL NOT NULL, last_error TEXT,
    PRIMARY KEY (profile_id, user_id, fact_id));
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (profile_id, state, user_id, enqueued_at);
CREATE TABLE IF NOT EXISTS kv_entries (
    profile_id TEXT NOT NULL, user_id TEXT NOT NULL, fact_id TEXT NOT NULL, version INTEGER NOT NULL,
    content_id TEXT NOT NULL, token_ids TEXT NOT NULL, nbytes INTEGER NOT NULL, stored_at REAL NOT NULL,
    PRIMARY KEY (profile_id, user_id, fact_id));
"""

QUEUED, LEASED, FAILED = "queued", "leased", "failed"


@dataclass(frozen=True)
class Job:
    """Queued work: KV wanted for one version of a fact under one profile."""

    profile_id: str
    user_id: str
    fact_id: str
    version: int


@dataclass(frozen=True)
class KvEntry:
    key: KvKey
    token_ids: list[int]
    nbytes: int


@dataclass(frozen=True)
class QueueCounts:
    queued: int
    leased: int
    failed: int
    done: int
    kv_bytes: int
    lag_seconds: float


class KvIndex:
    def __init__(self, path: Path, max_attempts: int = 3) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        if self._db.execute("PRAGMA user_version").fetchone()[0] < _SCHEMA_VERSION:
            self._db.executescript("DROP TABLE IF EXISTS jobs; DROP TABLE IF EXISTS kv_entries;")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        self._lock = threading.Lock()
        self.max_attempts = max_attempts

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transaction(self, statements: Iterable[tuple[str, Sequence]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    self._db.execute(sql, params)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _query(self, sql: str, params: Sequence = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # ------------------------------------------------------------------ profiles

    def add_profile(self, profile_id: str, spec: dict) -> bool:
        """Records a profile; True when it is new."""
        now = time.time()
        with self._lock:
            known = self._db.execute("SELECT 1 FROM profiles WHERE profile_id = ?", (profile_id,)).fetchone()
            if known:
                self._db.execute("UPDATE profiles SET last_seen = ? WHERE profile_id = ?", (now, profile_id))
            else:
                self._db.execute("INSERT INTO profiles VALUES (?, ?, ?, ?)", (profile_id, json.dumps(spec), now, now))
        return not known

    def profiles(self) -> dict[str, dict]:
        return {profile_id: json.loads(spec) for profile_id, spec in self._query("SELECT profile_id, spec FROM profiles")}

    # ------------------------------------------------------------------ queue

    def enqueue(self, profile_ids: Iterable[str], facts: Iterable[tuple[str, str, int]]) -> int:
        """Queues (user, fact, version) for each profile, replacing older versions' jobs."""
        now = time.time()
        rows = [(p, u, f, v, QUEUED, now) for p in profile_ids for (u, f, v) in facts]
        self._transaction(
            ("INSERT INTO jobs (profile_id, user_id, fact_id, version, state, enqueued_at) VALUES (?, ?, ?, ?, ?, ?) "
             "ON CONFLICT(profile_id, user_id, fact_id) DO UPDATE SET version = excluded.version, state = 'queued', "
             "lease_id = NULL, lease_expires = NULL, attempts = 0, enqueued_at = excluded.enqueued_at, "
             "last_error = NULL", row)
            for row in rows
        )
        return len(rows)

    def lease(self, profile_id: str, max_facts: int, lease_seconds: float) -> tuple[str, float, list[Job]]:
        """Leases queued (or expired) jobs, grouped by user; jobs leased too often become failed."""
        now = time.time()
        lease_id = uuid.uuid4().hex
        expires = now + lease_seconds
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "UPDATE jobs SET state = 'failed', last_error = coalesce(last_error, 'lease expired too often') "
                    "WHERE profile_id = ? AND state = 'leased' AND lease_expires < ? AND attempts >= ?",
                    (profile_id, now, self.max_attempts),
                )
                rows = self._db.execute(
                    "SELECT user_id, fact_id, version FROM jobs WHERE profile_id = ? AND "
                    "(state = 'queued' OR (state = 'leased' AND lease_expires < ?)) "
                    "ORDER BY user_id, enqueued_at LIMIT ?",
                    (profile_id, now, max_facts),
                ).fetchall()
                self._db.executemany(
                    "UPDATE jobs SET state = 'leased', lease_id = ?, lease_expires = ?, attempts = attempts + 1 "
                    "WHERE profile_id = ? AND user_id = ? AND fact_id = ?",
                    [(lease_id, expires, profile_id, user, fact) for user, fact, _ in rows],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return lease_id, expires, [Job(profile_id, user, fact, version) for user, fact, version in rows]

    def job_version(self, profile_id: str, user_id: str, fact_id: str) -> int | None:
        return self.job_versions(profile_id, user_id, [fact_id]).get(fact_id)

    def fail(self, job: Job, lease_id: str, error: str) -> None:
        """Returns a failed job to the queue, or marks it failed after max_attempts (only under its lease)."""
        self._transaction([(
            "UPDATE jobs SET state = CASE WHEN attempts >= ? THEN 'failed' ELSE 'queued' END, lease_id = NULL, "
            "lease_expires = NULL, last_error = ? WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
            "AND lease_id = ?",
            (self.max_attempts, error[:500], job.profile_id, job.user_id, job.fact_id, job.version, lease_id),
        )])

    # ------------------------------------------------------------------ stored KV

    def lease_holds(self, key: KvKey, lease_id: str) -> bool:
        """Whether `lease_id` still holds the job for key's fact at key's version."""
        return bool(self._query(
            "SELECT 1 FROM jobs WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? AND lease_id = ?",
            (key.profile_id, key.user_id, key.fact_id, key.version, lease_id)))

    def record_stored(self, key: KvKey, token_ids: Sequence[int], nbytes: int, lease_id: str | None) -> bool:
        """Marks KV stored for key, in one transaction with taking its job off the queue: with a `lease_id`, only
        while that lease still holds the job for key's version (else nothing changes and False is returned);
        without one (the profile's header), unconditionally."""
        where = (key.profile_id, key.user_id, key.fact_id)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if lease_id is not None:
                    taken = self._db.execute(
                        "DELETE FROM jobs WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
                        "AND lease_id = ?", (*where, key.version, lease_id)).rowcount
                    if taken != 1:
                        self._db.execute("ROLLBACK")
                        return False
                self._db.execute("INSERT OR REPLACE INTO kv_entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                 (*where, key.version, key.content_id, json.dumps(list(token_ids)), nbytes,
                                  time.time()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def entry(self, profile_id: str, user_id: str, fact_id: str) -> KvEntry | None:
        return self.entries(profile_id, user_id, [fact_id]).get(fact_id)

    def header_entry(self, profile_id: str) -> KvEntry | None:
        return self.entry(profile_id, HEADER_OWNER, HEADER_FACT_ID)

    def entries(self, profile_id: str, user_id: str, fact_ids: Sequence[str]) -> dict[str, KvEntry]:
        if not fact_ids:
            return {}
        placeholders = ",".join("?" * len(fact_ids))
        rows = self._query(
            f"SELECT fact_id, version, content_id, token_ids, nbytes FROM kv_entries WHERE profile_id = ? "
            f"AND user_id = ? AND fact_id IN ({placeholders})", (profile_id, user_id, *fact_ids))
        return {fact: KvEntry(KvKey(profile_id, user_id, fact, version, content), json.loads(tokens), nbytes)
                for fact, version, content, tokens, nbytes in rows}

    def job_versions(self, profile_id: str, user_id: str, fact_ids: Sequence[str]) -> dict[str, int]:
        """The queued (or leased, or failed) version of each of `fact_ids` that has a job."""
        if not fact_ids:
            return {}
        placeholders = ",".join("?" * len(fact_ids))
        return dict(self._query(f"SELECT fact_id, version FROM jobs WHERE profile_id = ? AND user_id = ? "
                                f"AND fact_id IN ({placeholders})", (profile_id, user_id, *fact_ids)))

    def all_entry_keys(self) -> list[KvKey]:
        return [KvKey(*row) for row in self._query(
            "SELECT profile_id, user_id, fact_id, version, content_id FROM kv_entries")]

    def all_jobs(self) -> list[Job]:
        return [Job(*row) for row in self._query("SELECT profile_id, user_id, fact_id, version FROM jobs")]

    def forget_entry(self, key: KvKey) -> None:
        self._transaction([("DELETE FROM kv_entries WHERE profile_id = ? AND user_id = ? AND fact_id = ? "
                            "AND version = ? AND content_id = ?",
                            (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id))])

    def forget_facts(self, user_id: str, fact_ids: Sequence[str] | None) -> list[KvKey]:
        """Drops jobs and entries of the given facts (all of the user's when None), for every profile;
        returns the stored keys that were dropped."""
        condition, params = "user_id = ?", [user_id]
        if fact_ids is not None:
            condition += f" AND fact_id IN ({','.join('?' * len(fact_ids))})"
            params += list(fact_ids)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                stored = [KvKey(*row) for row in self._db.execute(
                    f"SELECT profile_id, user_id, fact_id, version, content_id FROM kv_entries WHERE {condition}",
                    params).fetchall()]
                self._db.execute(f"DELETE FROM kv_entries WHERE {condition}", params)
                self._db.execute(f"DELETE FROM jobs WHERE {condition}", params)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return stored

    def kv_bytes_with_user_prefix(self, prefix: str) -> int:
        """Bytes of stored fact KV, over every profile, of the users whose id starts with `prefix`."""
        return self._query("SELECT coalesce(sum(nbytes), 0) FROM kv_entries WHERE substr(user_id, 1, ?) = ? "
                           "AND user_id != ?", [len(prefix), prefix, HEADER_OWNER])[0][0]

    def counts(self, profile_id: str, user_id: str = "") -> QueueCounts:
        user_filter, params = (" AND user_id = ?", [user_id]) if user_id else ("", [])
        now = time.time()
        states = dict(self._query(
            "SELECT CASE WHEN state = 'leased' AND lease_expires < ? THEN 'queued' ELSE state END AS s, count(*) "
            f"FROM jobs WHERE profile_id = ?{user_filter} GROUP BY s", [now, profile_id, *params]))
        oldest = self._query(f"SELECT min(enqueued_at) FROM jobs WHERE profile_id = ? AND state != 'failed'{user_filter}",
                             [profile_id, *params])[0][0]
        done, kv_bytes = self._query(
            "SELECT count(*), coalesce(sum(nbytes), 0) FROM kv_entries WHERE profile_id = ? AND user_id != ?"
            f"{user_filter}", [profile_id, HEADER_OWNER, *params])[0]
        return QueueCounts(queued=states.get(QUEUED, 0), leased=states.get(LEASED, 0), failed=states.get(FAILED, 0),
                           done=done, kv_bytes=kv_bytes, lag_seconds=max(0.0, now - oldest) if oldest else 0.0)
