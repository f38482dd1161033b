"""The KV work queue (table `jobs`): one job per (profile, user, fact) wanting KV for one version of the fact, leased
to precompute workers. A lease expires if its worker dies; a job leased `max_attempts` times without completing is
marked failed. A job leaves the queue when its KV is recorded (coordination.kv_index) or its fact is forgotten."""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from inferscale_kv.kv_key import KvKey
from memory_service.sql import Database, Transaction

QUEUED, LEASED, FAILED = "queued", "leased", "failed"
# How long a lease's holder is remembered after the lease expired: a completion that comes later (a worker stalled for
# a day) is refused as not the caller's, like a lease never issued.
LEASE_HOLDER_RETENTION_S = 24 * 3600
# What a lease id looks like (uuid4().hex): anything else names no lease.
LEASE_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Job:
    """Queued work: KV wanted for one version of a fact under one profile."""

    profile_id: str
    user_id: str
    fact_id: str
    version: int


class LeasedJobs(NamedTuple):
    lease_id: str
    expires_at: float  # seconds since the epoch
    jobs: list[Job]


@dataclass(frozen=True)
class QueueCounts:
    """A profile's jobs by state (a lease past its expiry counts as queued) and the age of the oldest unfailed one."""

    queued: int
    leased: int
    failed: int
    lag_seconds: float


def lease_digest(lease_id: str) -> str:
    """What logs show of a lease id (which works as its holder's capability): enough to correlate lines, not to use."""
    return hashlib.sha256(lease_id.encode()).hexdigest()[:16]


def facts_condition(user_id: str, fact_ids: Sequence[str] | None) -> tuple[str, list[str]]:
    """The WHERE clause (and its parameters) naming the given facts of a user, or all of them (None)."""
    condition, params = "user_id = ?", [user_id]
    if fact_ids is not None:
        condition += f" AND fact_id IN ({','.join('?' * len(fact_ids))})"
        params += list(fact_ids)
    return condition, params


_EXCLUDED = ("NOT EXISTS (SELECT 1 FROM kv_exclusions x WHERE x.profile_id = {table}.profile_id AND "
             "x.user_id = {table}.user_id AND x.fact_id = {table}.fact_id AND x.version = {table}.version AND "
             "x.worker_id = ?)")
# Queues a job for (profile, user, fact, version, state, enqueued_at), replacing the fact's job of an older version.
_UPSERT_JOB = ("INSERT INTO jobs (profile_id, user_id, fact_id, version, state, enqueued_at) "
               "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (profile_id, user_id, fact_id) DO UPDATE SET "
               "version = excluded.version, state = 'queued', lease_id = NULL, lease_expires = NULL, "
               "attempts = 0, enqueued_at = excluded.enqueued_at, last_error = NULL "
               "WHERE jobs.version <= excluded.version")  # a late, older version never replaces a newer


def not_excluded(table: str) -> str:
    """A WHERE condition on `table`'s rows (a fact version each): the worker named by the condition's one parameter
    is not barred from that fact version (table `kv_exclusions`, coordination.audits)."""
    return _EXCLUDED.format(table=table)


class KvWorkQueue:
    def __init__(self, database: Database, max_attempts: int = 3) -> None:
        self._database = database
        self.max_attempts = max_attempts

    def enqueue(self, profile_ids: Iterable[str], facts: Iterable[tuple[str, str, int]]) -> int:
        """Queues (user, fact, version) for each profile, replacing older versions' jobs; returns the jobs written.
        Rows are written in key order, so that concurrent enqueues of overlapping facts (replicas answering one
        user's queries, each in its own rank order) take their row locks in the same order and cannot deadlock."""
        now = time.time()
        rows = sorted((p, u, f, v, QUEUED, now) for p in profile_ids for (u, f, v) in facts)
        with self._database.transaction() as tx:
            for row in rows:
                tx.run(_UPSERT_JOB, row)
        return len(rows)

    def lease(self, profile_id: str, max_facts: int, lease_seconds: float, worker_id: str = "",
              lease_id: str | None = None) -> LeasedJobs:
        """Leases queued (or expired) jobs that `worker_id` is not barred from (coordination.audits), grouped by
        user, under `lease_id` (a new one when None); jobs leased too often become failed."""
        now = time.time()
        lease_id = lease_id or uuid.uuid4().hex
        expires = now + lease_seconds
        with self._database.transaction() as tx:
            tx.run("UPDATE jobs SET state = 'failed', last_error = coalesce(last_error, 'lease expired too often') "
                   "WHERE profile_id = ? AND state = 'leased' AND lease_expires < ? AND attempts >= ?",
                   (profile_id, now, self.max_attempts))
            rows = tx.rows("SELECT user_id, fact_id, version FROM jobs WHERE profile_id = ? AND "
                           "(state = 'queued' OR (state = 'leased' AND lease_expires < ?)) AND "
                           f"{not_excluded('jobs')} ORDER BY user_id, enqueued_at LIMIT ?"
                           + self._database.claim_clause, (profile_id, now, worker_id, max_facts))
            for user, fact, _ in rows:
                tx.run("UPDATE jobs SET state = 'leased', lease_id = ?, lease_expires = ?, attempts = attempts + 1 "
                       "WHERE profile_id = ? AND user_id = ? AND fact_id = ?",
                       (lease_id, expires, profile_id, user, fact))
        return LeasedJobs(lease_id, expires, [Job(profile_id, user, fact, version) for user, fact, version in rows])

    def record_holder(self, lease_id: str, holder: str, expires_at: float) -> None:
        """Records that `holder` (a worker identity) holds `lease_id` (facts or audits) until `expires_at`, and forgets
        the holders of leases expired more than LEASE_HOLDER_RETENTION_S ago."""
        with self._database.transaction() as tx:
            tx.run("DELETE FROM kv_leases WHERE expires < ?", (time.time() - LEASE_HOLDER_RETENTION_S,))
            tx.run("INSERT INTO kv_leases (lease_id, holder, expires) VALUES (?, ?, ?)",
                   (lease_id, holder, expires_at))

    def holder(self, lease_id: str) -> str | None:
        """The worker identity that was given `lease_id` (None: never issued, or forgotten)."""
        rows = self._database.query("SELECT holder FROM kv_leases WHERE lease_id = ?", (lease_id,))
        return rows[0][0] if rows else None

    def requeue(self, tx: Transaction, key: KvKey) -> None:
        """Within `tx`: queues key's fact at key's version for the profile (its stored KV was withdrawn)."""
        tx.run(_UPSERT_JOB, (key.profile_id, key.user_id, key.fact_id, key.version, QUEUED, time.time()))

    def fail(self, job: Job, lease_id: str, error: str) -> None:
        """Returns a failed job to the queue, or marks it failed after max_attempts (only under its lease)."""
        with self._database.transaction() as tx:
            tx.run("UPDATE jobs SET state = CASE WHEN attempts >= ? THEN 'failed' ELSE 'queued' END, lease_id = NULL, "
                   "lease_expires = NULL, last_error = ? WHERE profile_id = ? AND user_id = ? AND fact_id = ? "
                   "AND version = ? AND lease_id = ?",
                   (self.max_attempts, error[:500], job.profile_id, job.user_id, job.fact_id, job.version, lease_id))

    def lease_holds(self, key: KvKey, lease_id: str) -> bool:
        """Whether `lease_id` still holds the job for key's fact at key's version."""
        return bool(self._database.query(
            "SELECT 1 FROM jobs WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? AND lease_id = ?",
            (key.profile_id, key.user_id, key.fact_id, key.version, lease_id)))

    def take_job(self, tx: Transaction, key: KvKey, lease_id: str) -> bool:
        """Within `tx`: removes the job for key's fact at key's version if `lease_id` still holds it."""
        return tx.run("DELETE FROM jobs WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
                      "AND lease_id = ?", (key.profile_id, key.user_id, key.fact_id, key.version, lease_id)) == 1

    def drop_jobs(self, tx: Transaction, user_id: str, fact_ids: Sequence[str] | None) -> None:
        """Within `tx`: removes the jobs of the given facts (all of the user's when None), for every profile."""
        condition, params = facts_condition(user_id, fact_ids)
        tx.run(f"DELETE FROM jobs WHERE {condition}", params)

    def job_versions(self, profile_id: str, user_id: str, fact_ids: Sequence[str]) -> dict[str, int]:
        """The queued (or leased, or failed) version of each of `fact_ids` that has a job."""
        if not fact_ids:
            return {}
        placeholders = ",".join("?" * len(fact_ids))
        return dict(self._database.query(f"SELECT fact_id, version FROM jobs WHERE profile_id = ? AND user_id = ? "
                                         f"AND fact_id IN ({placeholders})", (profile_id, user_id, *fact_ids)))

    def all_jobs(self) -> list[Job]:
        return [Job(*row) for row in self._database.query("SELECT profile_id, user_id, fact_id, version FROM jobs")]

    def counts(self, profile_id: str, user_id: str = "") -> QueueCounts:
        """The profile's jobs (of one user, or of all users)."""
        user_filter, params = (" AND user_id = ?", [user_id]) if user_id else ("", [])
        now = time.time()
        states = dict(self._database.query(
            "SELECT CASE WHEN state = 'leased' AND lease_expires < ? THEN 'queued' ELSE state END AS s, count(*) "
            f"FROM jobs WHERE profile_id = ?{user_filter} GROUP BY s", [now, profile_id, *params]))
        oldest = self._database.query(
            f"SELECT min(enqueued_at) FROM jobs WHERE profile_id = ? AND state != 'failed'{user_filter}",
            [profile_id, *params])[0][0]
        return QueueCounts(queued=states.get(QUEUED, 0), leased=states.get(LEASED, 0), failed=states.get(FAILED, 0),
                           lag_seconds=max(0.0, now - oldest) if oldest else 0.0)
