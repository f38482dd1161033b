"""The KV audit (tables `kv_audits`, `kv_exclusions`, `kv_quarantine`): stored KV that another worker is to compute
again and compare, the workers barred from computing or auditing one version of a fact again, and KV kept aside after
an audit or a header found it wrong (never served; dropped with its fact, as the KV itself is).

An audit is leased to precompute workers beside the work queue's jobs, under the same lease id, and never to the
worker that produced the entry (nor to one barred from the fact). The profile's memory header is audited too, but not
leased as an item: a worker is asked for its header instead (coordination.kv_index.header_entry, LeaseKvWork's
header_kv_wanted)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, KvKey
from memory_service.coordination.work_queue import facts_condition, not_excluded
from memory_service.sql import Database, Transaction

# Audits one mismatch adds at most (KvAudits.escalate).
ESCALATED_AUDITS_MAX = 10_000
# kv_quarantine's reason for KV that differed from a stored entry which stayed served (KvAudits.dispute).
DISPUTE_REASON = "header conflict: a differing header, set aside"
# kv_quarantine's reason for a header no second worker identity has agreed with yet (KvAudits.propose_header).
CANDIDATE_REASON = "header candidate: waiting for a second worker to agree"
# ... and for a candidate that differed from the header two workers agreed on (KvAudits.settle_header).
OUTVOTED_REASON = "header candidate: outvoted by two workers that agreed on another"


@dataclass(frozen=True)
class Audit:
    """Stored KV (under exactly `key`) to be computed again by a worker other than its `producer`."""

    key: KvKey
    producer: str


@dataclass(frozen=True)
class QuarantinedBlob:
    """A blob kept aside: who uploaded it and why it is not served."""

    worker_id: str
    reason: str
    blob: bytes


class KvAudits:
    def __init__(self, database: Database, max_attempts: int) -> None:
        """`max_attempts`: leases of one audit before it is given up (`abandoned`)."""
        self._database = database
        self.max_attempts = max_attempts

    def schedule(self, tx: Transaction, key: KvKey, producer: str) -> None:
        """Within `tx`: the entry stored under `key` by `producer` is to be audited (replacing any audit of the
        fact's earlier KV)."""
        tx.run("INSERT INTO kv_audits (profile_id, user_id, fact_id, version, content_id, producer, enqueued_at) "
               "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (profile_id, user_id, fact_id) DO UPDATE SET "
               "version = excluded.version, content_id = excluded.content_id, producer = excluded.producer, "
               "lease_id = NULL, lease_expires = NULL, attempts = 0, enqueued_at = excluded.enqueued_at",
               (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id, producer, time.time()))

    def unschedule(self, tx: Transaction, key: KvKey) -> None:
        """Within `tx`: no audit of the fact's KV (its entry was replaced or dropped)."""
        tx.run("DELETE FROM kv_audits WHERE profile_id = ? AND user_id = ? AND fact_id = ?",
               (key.profile_id, key.user_id, key.fact_id))

    def escalate(self, profile_id: str, producers: Sequence[str]) -> int:
        """The fact entries of the profile stored by one of `producers` are to be audited, the newest
        ESCALATED_AUDITS_MAX of them (a mismatch costs a bounded amount of extra work); returns the audits added."""
        placeholders = ",".join("?" * len(producers))
        with self._database.transaction() as tx:
            return tx.run(
                "INSERT INTO kv_audits (profile_id, user_id, fact_id, version, content_id, producer, enqueued_at) "
                "SELECT profile_id, user_id, fact_id, version, content_id, producer, ? FROM kv_entries "
                f"WHERE profile_id = ? AND user_id != ? AND producer IN ({placeholders}) "
                "ORDER BY stored_at DESC LIMIT ? ON CONFLICT (profile_id, user_id, fact_id) DO NOTHING",
                (time.time(), profile_id, HEADER_OWNER, *producers, ESCALATED_AUDITS_MAX))

    def lease(self, profile_id: str, worker_id: str, max_facts: int, lease_id: str, expires: float) -> list[Audit]:
        """Leases up to `max_facts` fact audits that `worker_id` may do (it did not produce them, it is not barred,
        they are not `abandoned`) under `lease_id`, grouped by user."""
        now = time.time()
        with self._database.transaction() as tx:
            rows = tx.rows(
                "SELECT user_id, fact_id, version, content_id, producer FROM kv_audits WHERE profile_id = ? "
                "AND user_id != ? AND producer != ? AND (lease_id IS NULL OR lease_expires < ?) AND attempts < ? AND "
                f"{not_excluded('kv_audits')} ORDER BY user_id, enqueued_at LIMIT ?" + self._database.claim_clause,
                (profile_id, HEADER_OWNER, worker_id, now, self.max_attempts, worker_id, max_facts))
            for user, fact, *_ in rows:
                tx.run("UPDATE kv_audits SET lease_id = ?, lease_expires = ?, attempts = attempts + 1 "
                       "WHERE profile_id = ? AND user_id = ? AND fact_id = ?",
                       (lease_id, expires, profile_id, user, fact))
        return [Audit(KvKey(profile_id, user, fact, version, content), producer)
                for user, fact, version, content, producer in rows]

    def abandoned(self, profile_id: str) -> list[Audit]:
        """The profile's audits leased `max_attempts` times without a result (the last lease expired or was
        released): leased no more, they wait to be given up (KvIndex.quarantine withdraws their entries and removes
        them; `finish` an audit whose entry is gone)."""
        rows = self._database.query(
            "SELECT user_id, fact_id, version, content_id, producer FROM kv_audits WHERE profile_id = ? "
            "AND (lease_id IS NULL OR lease_expires < ?) AND attempts >= ?",
            (profile_id, time.time(), self.max_attempts))
        return [Audit(KvKey(profile_id, user, fact, version, content), producer)
                for user, fact, version, content, producer in rows]

    def held(self, profile_id: str, user_id: str, fact_id: str, version: int, lease_id: str) -> Audit | None:
        """The audit of the fact's version that `lease_id` holds, if any."""
        rows = self._database.query(
            "SELECT content_id, producer FROM kv_audits WHERE profile_id = ? AND user_id = ? AND fact_id = ? "
            "AND version = ? AND lease_id = ?", (profile_id, user_id, fact_id, version, lease_id))
        return Audit(KvKey(profile_id, user_id, fact_id, version, rows[0][0]), rows[0][1]) if rows else None

    def pending(self, key: KvKey) -> Audit | None:
        """The audit waiting for the entry stored under exactly `key`, if any."""
        rows = self._database.query(
            "SELECT producer FROM kv_audits WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
            "AND content_id = ?", (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id))
        return Audit(key, rows[0][0]) if rows else None

    def finish(self, audit: Audit) -> bool:
        """Removes the audit (its entry passed, or is gone); False if it was not there anymore."""
        key = audit.key
        with self._database.transaction() as tx:
            return tx.run("DELETE FROM kv_audits WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
                          "AND content_id = ?", (key.profile_id, key.user_id, key.fact_id, key.version,
                                                 key.content_id)) == 1

    def release(self, audit: Audit, lease_id: str) -> None:
        """The auditor could not compute the fact: the audit waits for another lease (if `lease_id` still holds it)."""
        key = audit.key
        with self._database.transaction() as tx:
            tx.run("UPDATE kv_audits SET lease_id = NULL, lease_expires = NULL WHERE profile_id = ? AND user_id = ? "
                   "AND fact_id = ? AND version = ? AND lease_id = ?",
                   (key.profile_id, key.user_id, key.fact_id, key.version, lease_id))

    def barred(self, key: KvKey) -> list[str]:
        """The workers barred from computing or auditing the fact version `key` names (its KV was withdrawn), sorted;
        empty when none is."""
        return [worker for (worker,) in self._database.query(
            "SELECT worker_id FROM kv_exclusions WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND version = ? "
            "ORDER BY worker_id", (key.profile_id, key.user_id, key.fact_id, key.version))]

    def exclude(self, tx: Transaction, key: KvKey, worker_ids: Sequence[str]) -> None:
        """Within `tx`: bars the workers from computing or auditing the fact version `key` names."""
        for worker_id in sorted(set(worker_ids)):
            tx.run("INSERT INTO kv_exclusions VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                   (key.profile_id, key.user_id, key.fact_id, key.version, worker_id))

    def keep_aside(self, tx: Transaction, key: KvKey, kept: Sequence[QuarantinedBlob]) -> None:
        """Within `tx`: keeps the blobs (uploaded for `key`) in quarantine, once per distinct blob."""
        for blob in kept:
            tx.run("INSERT INTO kv_quarantine VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                   (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id,
                    hashlib.sha256(blob.blob).hexdigest(), blob.worker_id, blob.reason, time.time(), blob.blob))

    def dispute(self, key: KvKey, kept: QuarantinedBlob) -> None:
        """A worker's differing KV for the entry stored under exactly `key`, which stays served: kept aside (its worker
        is one of `disputers(key)`)."""
        with self._database.transaction() as tx:
            self.keep_aside(tx, key, [kept])

    def propose_header(self, key: KvKey, candidate: QuarantinedBlob) -> None:
        """Keeps a worker's header for the profile `key` names as its candidate (never served), replacing the
        worker's earlier candidate: one per worker identity."""
        with self._database.transaction() as tx:
            tx.run("DELETE FROM kv_quarantine WHERE profile_id = ? AND user_id = ? AND fact_id = ? AND worker_id = ? "
                   "AND reason = ?", (key.profile_id, key.user_id, key.fact_id, candidate.worker_id, CANDIDATE_REASON))
            self.keep_aside(tx, key, [candidate])

    def header_candidates(self, profile_id: str) -> list[tuple[KvKey, QuarantinedBlob]]:
        """The profile's header candidates (`propose_header`), oldest first."""
        rows = self._database.query(
            "SELECT version, content_id, worker_id, blob FROM kv_quarantine WHERE profile_id = ? AND user_id = ? "
            "AND reason = ? ORDER BY quarantined_at", (profile_id, HEADER_OWNER, CANDIDATE_REASON))
        return [(KvKey(profile_id, HEADER_OWNER, HEADER_FACT_ID, version, content), QuarantinedBlob(
            worker, CANDIDATE_REASON, bytes(blob))) for version, content, worker, blob in rows]

    def header_candidate_workers(self, profile_id: str) -> list[str]:
        """The workers with a header candidate for the profile (`propose_header`), without their blobs."""
        return [worker for (worker,) in self._database.query(
            "SELECT DISTINCT worker_id FROM kv_quarantine WHERE profile_id = ? AND user_id = ? AND reason = ?",
            (profile_id, HEADER_OWNER, CANDIDATE_REASON))]

    def settle_header(self, key: KvKey, wrong: Sequence[str]) -> None:
        """Two worker identities agree on a header for the profile `key` names: the `wrong` workers (whose candidates
        differed) are barred from the header and their candidates kept aside as outvoted; the others are dropped."""
        with self._database.transaction() as tx:
            for worker_id in wrong:
                tx.run("UPDATE kv_quarantine SET reason = ? WHERE profile_id = ? AND user_id = ? AND reason = ? "
                       "AND worker_id = ?", (OUTVOTED_REASON, key.profile_id, HEADER_OWNER, CANDIDATE_REASON,
                                             worker_id))
            tx.run("DELETE FROM kv_quarantine WHERE profile_id = ? AND user_id = ? AND reason = ?",
                   (key.profile_id, HEADER_OWNER, CANDIDATE_REASON))
            self.exclude(tx, key, wrong)

    def awaiting_header(self) -> int:
        """Profiles with header candidates and no stored header: their memory is served as text meanwhile."""
        return self._database.query(
            "SELECT count(DISTINCT q.profile_id) FROM kv_quarantine q WHERE q.user_id = ? AND q.reason = ? AND NOT "
            "EXISTS (SELECT 1 FROM kv_entries e WHERE e.profile_id = q.profile_id AND e.user_id = q.user_id)",
            (HEADER_OWNER, CANDIDATE_REASON))[0][0]

    def disputers(self, key: KvKey) -> list[str]:
        """The workers whose KV differed from the entry stored under exactly `key` (`dispute`), sorted."""
        return [worker for (worker,) in self._database.query(
            "SELECT DISTINCT worker_id FROM kv_quarantine WHERE profile_id = ? AND user_id = ? AND fact_id = ? "
            "AND version = ? AND content_id = ? AND reason = ? ORDER BY worker_id",
            (key.profile_id, key.user_id, key.fact_id, key.version, key.content_id, DISPUTE_REASON))]

    def drop_facts(self, tx: Transaction, user_id: str, fact_ids: Sequence[str] | None) -> None:
        """Within `tx`: removes the audits, bars and quarantined KV of the given facts (all of the user's when None),
        for every profile."""
        condition, params = facts_condition(user_id, fact_ids)
        for table in ("kv_audits", "kv_exclusions", "kv_quarantine"):
            tx.run(f"DELETE FROM {table} WHERE {condition}", params)

    def waiting(self) -> int:
        """Audits not done yet, over every profile (the header's included)."""
        return self._database.query("SELECT count(*) FROM kv_audits")[0][0]
