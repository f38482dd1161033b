"""The coordination store: what every service replica must agree on, in one SQL database (SQLite by default,
PostgreSQL when replicas share it; memory_service.sql): announced profiles, the KV work queue with leases, which KV
is stored (its full key, content id included, and token ids), each user's write generation and version floor, and
the store's embedding model. Every call is one transaction, committed before it returns; check-and-record steps
(lease completion, delete cascades) are single transactions."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, KvKey
from memory_service.sql import Database

# Version 3 adds version floors and the store's embedding model, version 4 user write generations keyed by digest.
# At open, tables older than the version in which their layout last changed are dropped: bookkeeping older than
# version 2 (entries without content ids; its blobs then have no entry: reconcile deletes them and queues every fact
# again), write generations older than 4 (cache validity counters: replicas reload what they hold).
_SCHEMA_VERSION = 4
_DROPPED_BELOW = {"jobs": 2, "kv_entries": 2, "user_generations": 4}
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS profiles (profile_id TEXT PRIMARY KEY, spec TEXT NOT NULL, "
    "first_seen DOUBLE PRECISION NOT NULL, last_seen DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE IF NOT EXISTS jobs (profile_id TEXT NOT NULL, user_id TEXT NOT NULL, fact_id TEXT NOT NULL, "
    "version BIGINT NOT NULL, state TEXT NOT NULL, lease_id TEXT, lease_expires DOUBLE PRECISION, "
    "attempts BIGINT NOT NULL DEFAULT 0, enqueued_at DOUBLE PRECISION NOT NULL, last_error TEXT, "
    "PRIMARY KEY (profile_id, user_id, fact_id))",
    "CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (profile_id, state, user_id, enqueued_at)",
    "CREATE TABLE IF NOT EXISTS kv_entries (profile_id TEXT NOT NULL, user_id TEXT NOT NULL, fact_id TEXT NOT NULL, "
    "version BIGINT NOT NULL, content_id TEXT NOT NULL, token_ids TEXT NOT NULL, nbytes BIGINT NOT NULL, "
    "stored_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (profile_id, user_id, fact_id))",
    "CREATE TABLE IF NOT EXISTS user_generations (user_digest TEXT PRIMARY KEY, generation BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS version_floors (user_digest TEXT PRIMARY KEY, floor BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS workers (worker_id TEXT PRIMARY KEY, profile_id TEXT NOT NULL, "
    "last_seen DOUBLE PRECISION NOT NULL, facts_per_second DOUBLE PRECISION NOT NULL, device TEXT NOT NULL)",
)

QUEUED, LEASED, FAILED = "queued", "leased", "failed"


def user_digest(user_id: str) -> str:
    """Keys what the coordination store keeps of a user beyond its facts: a deleted user's id leaves nothing."""
    return hashlib.sha256(user_id.encode()).hexdigest()


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
class WorkerReport:
    """What a precompute worker last said of itself (with its lease request)."""

    worker_id: str
    profile_id: str
    last_seen: float
    facts_per_second: float
    device: dict  # DeviceReading's fields; empty without a GPU


@dataclass(frozen=True)
class QueueCounts:
    queued: int
    leased: int
    failed: int
    done: int
    kv_bytes: int
    lag_seconds: float


class CoordinationStore:
    def __init__(self, database: Database, max_attempts: int = 3) -> None:
        self.database = database
        self.max_attempts = max_attempts
        with database.migration() as tx:
            version = database.schema_version(tx)
            for table, layout_version in _DROPPED_BELOW.items():
                if version < layout_version:
                    tx.run(f"DROP TABLE IF EXISTS {table}")
            for statement in _SCHEMA:
                tx.run(statement)
            database.set_schema_version(tx, _SCHEMA_VERSION)

    @property
    def shared(self) -> bool:
        """Other service replicas write this store too."""
        return self.database.shared

    def close(self) -> None:
        self.database.close()

    def _query(self, sql: str, params: Sequence = ()) -> list[tuple]:
        return self.database.query(sql, params)

    # ------------------------------------------------------------------ profiles

    def add_profile(self, profile_id: str, spec: dict) -> bool:
        """Records a profile; True when it is new."""
        now = time.time()
        with self.database.transaction() as tx:
            added = tx.run("INSERT INTO profiles VALUES (?, ?, ?, ?) ON CONFLICT (profile_id) DO NOTHING",
                           (profile_id, json.dumps(spec), now, now))
            if not added:
                tx.run("UPDATE profiles SET last_seen = ? WHERE profile_id = ?", (now, profile_id))
        return added == 1

    def profiles(self) -> dict[str, dict]:
        return {profile_id: json.loads(spec) for profile_id, spec in self._query("SELECT profile_id, spec FROM profiles")}

    # ------------------------------------------------------------------ queue

    def enqueue(self, profile_ids: Iterable[str], facts: Iterable[tuple[str, str, int]]) -> int:
        """Queues (user, fact, version) for each profile, replacing older versions' jobs. Rows are written in key
        order, so that concurrent enqueues of overlapping facts (replicas answering one user's queries, each in
        its own rank order) take their row locks in the same order and cannot deadlock."""
        now = time.time()
        rows = sorted((p, u, f, v, QUEUED, now) for p in profile_ids for (u, f, v) in facts)
        with self.database.transaction() as tx:
            for row in rows:
                tx.run("INSERT INTO jobs (profile_id, user_id, fact_id, version, state, enqueued_at) "
                       "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (profile_id, user_id, fact_id) DO UPDATE SET "
                       "version = excluded.version, state = 'queued', lease_id = NULL, lease_expires = NULL, "
                       "attempts = 0, enqueued_at = excluded.enqueued_at, last_error = NULL "
                       "WHERE jobs.version <= excluded.version", row)  # a late, older version never replaces a newer
        return len(rows)

    def lease(self, profile_id: str, max_facts: int, lease_seconds: float) -> tuple[str, float, list[Job]]:
        """Leases queued (or expired) jobs, grouped by user; jobs leased too often become failed."""
        now = time.time()
        lease_id = uuid.uuid4().hex
        expires = now + lease_seconds
        with self.database.transaction() as tx:
            tx.run("UPDATE jobs SET state = 'failed', last_error = coalesce(last_error, 'lease expired too often') "
                   "WHERE profile_id = ? AND state = 'leased' AND lease_expires < ? AND attempts >= ?",
                   (profile_id, now, self.max_attempts))
            rows = tx.rows("SELECT user_id, fact_id, version FROM jobs WHERE profile_id = ? AND "
                           "(state = 'queued' OR (state = 'leased' AND lease_expires < ?)) "
                           "ORDER BY user_id, enqueued_at LIMIT ?" + self.database.claim_clause,
                           (profile_id, now, max_facts))
            for user, fact, _ in rows:
                tx.run("UPDATE jobs SET state = 'leased', lease_id = ?, lease_expires = ?, attempts = attempts + 1 "
                       "WHERE profile_id = ? AND user_id = ? AND fact_id = ?",
                       (lease_id, expires, profile_id, user, fact))
        return lease_id, expires, [Job(profile_id, user, fact, version) for user, fact, version in rows]

    def job_version(self, profile_id: str, user_id: str, fact_id: str) -> int | None:
        return self.job_versions(profile_id, user_id, [fact_id]).get(fact_id)

    def fail(self, job: Job, lease_id: str, error: str) -> None:
        """Returns a failed job to the queue, or marks it failed after max_attempts (only under its lease)."""
        with self.database.transaction() as tx:
            tx.run("UPDATE jobs SET state = CASE WHEN attempts >= ? THEN 'failed' ELSE 'queued' END, lease_id = NULL, "
                   "lease_expires = NULL, last_error = ? WHERE profile_id = ? AND user_id = ? AND fact_id = ? "
                   "AND version = ? AND lease_id = ?",
                   (self.max_attempts, error[:500], job.profile_id, job.user_id, job.fact_id, job.version, lease_id))

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
        with self.database.transaction() as tx:
            if lease_id is not None and tx.run("DELETE FROM jobs WHERE profile_id = ? AND user_id = ? AND fact_id = ? "
                                               "AND version = ? AND lease_id = ?",
                                               (*where, key.version, lease_id)) != 1:
                return False  # nothing changed: the lease no longer holds the job
            tx.run("INSERT INTO kv_entries VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (profile_id, user_id, fact_id) "
                   "DO UPDATE SET version = excluded.version, content_id = excluded.content_id, "
                   "token_ids = excluded.token_ids, nbytes = excluded.nbytes, stored_at = excluded.stored_at",
                   (*where, key.version, key.content_id, json.dumps(list(token_ids)), nbytes, time.time()))
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
        with self.database.transaction() as tx:
            tx.run("DELETE FROM kv_entries WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
                   "AND content_id = ?", (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id))

    def forget_facts(self, user_id: str, fact_ids: Sequence[str] | None) -> list[KvKey]:
        """Drops jobs and entries of the given facts (all of the user's when None), for every profile;
        returns the stored keys that were dropped."""
        condition, params = "user_id = ?", [user_id]
        if fact_ids is not None:
            condition += f" AND fact_id IN ({','.join('?' * len(fact_ids))})"
            params += list(fact_ids)
        with self.database.transaction() as tx:
            # Jobs first: under PostgreSQL's READ COMMITTED this waits for a completion that holds one of them, and
            # the entries are then read afresh, the completion's included (entries first could miss it).
            tx.run(f"DELETE FROM jobs WHERE {condition}", params)
            stored = [KvKey(*row) for row in tx.rows(
                f"DELETE FROM kv_entries WHERE {condition} RETURNING profile_id, user_id, fact_id, version, content_id",
                params)]
        return stored

    def kv_bytes_with_user_prefix(self, prefix: str) -> int:
        """Bytes of stored fact KV, over every profile, of the users whose id starts with `prefix`."""
        return self._query("SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM kv_entries "
                           "WHERE substr(user_id, 1, ?) = ? AND user_id != ?",
                           [len(prefix), prefix, HEADER_OWNER])[0][0]

    def counts(self, profile_id: str, user_id: str = "") -> QueueCounts:
        user_filter, params = (" AND user_id = ?", [user_id]) if user_id else ("", [])
        now = time.time()
        states = dict(self._query(
            "SELECT CASE WHEN state = 'leased' AND lease_expires < ? THEN 'queued' ELSE state END AS s, count(*) "
            f"FROM jobs WHERE profile_id = ?{user_filter} GROUP BY s", [now, profile_id, *params]))
        oldest = self._query(f"SELECT min(enqueued_at) FROM jobs WHERE profile_id = ? AND state != 'failed'{user_filter}",
                             [profile_id, *params])[0][0]
        done, kv_bytes = self._query(
            "SELECT count(*), CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM kv_entries WHERE profile_id = ? "
            f"AND user_id != ?{user_filter}", [profile_id, HEADER_OWNER, *params])[0]
        return QueueCounts(queued=states.get(QUEUED, 0), leased=states.get(LEASED, 0), failed=states.get(FAILED, 0),
                           done=done, kv_bytes=kv_bytes, lag_seconds=max(0.0, now - oldest) if oldest else 0.0)

    # ------------------------------------------------------------------ users

    # A user's write generation is a sequence lock: odd while a write of the user is under way (or was cut off), even
    # otherwise. A replica's cached copy of the user is current only while the generation is even and has not moved
    # since the copy was read. Rows are keyed by a digest of the user id (a deleted user's id leaves nothing).

    def write_generation(self, user_id: str) -> int:
        rows = self._query("SELECT generation FROM user_generations WHERE user_digest = ?", (user_digest(user_id),))
        return rows[0][0] if rows else 0

    def write_generations(self, user_ids: Sequence[str]) -> dict[str, int]:
        """write_generation of each user, in one query per 500 users."""
        digests = {user_digest(user): user for user in user_ids}
        generations = dict.fromkeys(user_ids, 0)
        keys = list(digests)
        for begin in range(0, len(keys), 500):
            batch = keys[begin : begin + 500]
            for digest, generation in self._query(f"SELECT user_digest, generation FROM user_generations WHERE "
                                                  f"user_digest IN ({','.join('?' * len(batch))})", batch):
                generations[digests[digest]] = generation
        return generations

    def _advance_generation(self, user_id: str, step: int) -> int:
        with self.database.transaction() as tx:
            return tx.rows("INSERT INTO user_generations VALUES (?, ?) ON CONFLICT (user_digest) DO UPDATE SET "
                           "generation = user_generations.generation + ? RETURNING generation",
                           (user_digest(user_id), step, step))[0][0]

    def begin_write(self, user_id: str, generation: int) -> int:
        """Before a write of the user commits: every cached copy of the user stops being current (odd).
        `generation`: the user's write generation, read by the caller under the user's lock."""
        return self._advance_generation(user_id, 1 if generation % 2 == 0 else 2)

    def end_write(self, user_id: str) -> int:
        """After the write committed (or failed): copies read from now on may be cached (even)."""
        return self._advance_generation(user_id, 1)

    def invalidate_user(self, user_id: str) -> int:
        """Makes every replica look at the user again (e.g. its KV was forgotten) without marking a write."""
        return self._advance_generation(user_id, 2)

    def version_floor(self, user_digest: str) -> int:
        """The highest fact version the user ever had deleted (0: none): new versions start above it."""
        rows = self._query("SELECT floor FROM version_floors WHERE user_digest = ?", (user_digest,))
        return rows[0][0] if rows else 0

    def raise_version_floor(self, user_digest: str, version: int) -> None:
        with self.database.transaction() as tx:
            tx.run("INSERT INTO version_floors VALUES (?, ?) ON CONFLICT (user_digest) DO UPDATE SET "
                   "floor = CASE WHEN version_floors.floor > excluded.floor THEN version_floors.floor "
                   "ELSE excluded.floor END", (user_digest, version))

    def user_lock(self, user_id: str):
        """Held while the user's facts are written: no other replica writes that user meanwhile."""
        return self.database.user_lock(user_id)

    # ------------------------------------------------------------------ the store

    def claim_store_meta(self, name: str, value: str) -> str:
        """Records `value` under `name` unless one is recorded already; returns the recorded one."""
        with self.database.transaction() as tx:
            tx.run("INSERT INTO store_meta VALUES (?, ?) ON CONFLICT (name) DO NOTHING", (name, value))
            return tx.rows("SELECT value FROM store_meta WHERE name = ?", (name,))[0][0]

    # ------------------------------------------------------------------ workers

    def record_worker(self, report: WorkerReport) -> None:
        with self.database.transaction() as tx:
            tx.run("INSERT INTO workers VALUES (?, ?, ?, ?, ?) ON CONFLICT (worker_id) DO UPDATE SET "
                   "profile_id = excluded.profile_id, last_seen = excluded.last_seen, "
                   "facts_per_second = excluded.facts_per_second, device = excluded.device",
                   (report.worker_id, report.profile_id, report.last_seen, report.facts_per_second,
                    json.dumps(report.device, sort_keys=True)))

    def workers(self, seen_within_s: float) -> list[WorkerReport]:
        """Workers that leased within the last `seen_within_s` seconds, most recent first."""
        rows = self._query("SELECT worker_id, profile_id, last_seen, facts_per_second, device FROM workers "
                           "WHERE last_seen >= ? ORDER BY last_seen DESC", (time.time() - seen_within_s,))
        return [WorkerReport(worker, profile, seen, rate, json.loads(device))
                for worker, profile, seen, rate, device in rows]
