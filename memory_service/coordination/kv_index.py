"""The KV index (table `kv_entries`): which fact KV is stored, under its full key (content id included), with its
token ids, size and the worker that produced it. What the index lists is what the KV tiers may serve
(memory_service.kv_store). Recording an entry takes its job off the work queue (and schedules its audit when asked),
forgetting facts drops their jobs and audits, and quarantining an entry unlists it, keeps its blobs aside and queues
its fact again for other workers, each in one transaction.

Every change of a user's entries also moves the user's KV generation (table `kv_generations`), in the same
transaction: a trigger on `kv_entries` does it (memory_service.coordination.schema), so no writer can skip it, an
older replica's or a hand-written statement included. `serving_entries`, the lookup of every RetrieveAndStage,
answers from this process's copy of the entries it looked up before, while the user's and the header's generations
are the ones the copy was read at: one statement (both generations) instead of two lookups, and coherent across
replicas, since a change made through any of them moves the generation before the next call reads it."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, KvKey
from memory_service.coordination.audits import KvAudits, QuarantinedBlob
from memory_service.coordination.users import user_digest
from memory_service.coordination.work_queue import KvWorkQueue, facts_condition
from memory_service.sql import Database

# What the serving copy keeps, over every user, counted as entries (known absences too) plus their token ids; the
# least recently used users go first.
SERVING_COPY_SIZE = 2_000_000
HEADER_DIGEST = user_digest(HEADER_OWNER)


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


class _ServingCopy:
    """Entries of (profile, user) looked up before, each user's labelled with the KV generation it was read at; a
    fact id maps to None where the index had no entry for it. Thread-safe (lookups run on the read threads)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._users: OrderedDict[tuple[str, str], tuple[int, dict[str, KvEntry | None]]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def known(self, owner: tuple[str, str], generation: int,
              fact_ids: Sequence[str]) -> dict[str, KvEntry | None]:
        """What is known of `fact_ids` of the owner at `generation` (nothing if the copy is of another generation)."""
        with self._lock:
            cached = self._users.get(owner)
            if cached is None or cached[0] != generation:
                return {}
            self._users.move_to_end(owner)
            entries = cached[1]
            return {fact: entries[fact] for fact in fact_ids if fact in entries}

    def learn(self, owner: tuple[str, str], generation: int, looked_up: dict[str, KvEntry | None]) -> None:
        """Adds what a lookup made after reading `generation` found."""
        with self._lock:
            cached = self._users.pop(owner, None)
            entries: dict[str, KvEntry | None] = {}
            if cached is not None:
                self._size -= _size(cached[1])
                if cached[0] == generation:
                    entries = cached[1]
            entries.update(looked_up)
            self._users[owner] = (generation, entries)
            self._size += _size(entries)
            while self._size > self.capacity and self._users:
                self._size -= _size(self._users.popitem(last=False)[1][1])


def _size(entries: dict[str, KvEntry | None]) -> int:
    return len(entries) + sum(len(entry.token_ids) for entry in entries.values() if entry is not None)


class KvIndex:
    def __init__(self, database: Database, work_queue: KvWorkQueue, audits: KvAudits,
                 serving_copy_size: int = SERVING_COPY_SIZE) -> None:
        self._database = database
        self._work_queue = work_queue
        self._audits = audits
        self._serving_copy = _ServingCopy(serving_copy_size)

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

    def serving_entries(self, profile_id: str, user_id: str,
                        fact_ids: Sequence[str]) -> tuple[dict[str, KvEntry], KvEntry | None]:
        """What `entries(profile_id, user_id, fact_ids)` and `header_entry(profile_id)` answer, from the serving copy
        where the user's and the header's KV generations have not moved since it was read: one statement when the
        copy knows every fact, one more for the facts (or header) it does not."""
        digests = (user_digest(user_id), HEADER_DIGEST)
        generation = dict(self._database.query(
            "SELECT user_digest, generation FROM kv_generations WHERE user_digest IN (?, ?)", digests))
        user = self._served(profile_id, user_id, fact_ids, generation.get(digests[0], 0))
        header = self._served(profile_id, HEADER_OWNER, [HEADER_FACT_ID], generation.get(HEADER_DIGEST, 0))
        return ({fact: entry for fact, entry in user.items() if entry is not None},
                header.get(HEADER_FACT_ID))

    def _served(self, profile_id: str, user_id: str, fact_ids: Sequence[str],
                generation: int) -> dict[str, KvEntry | None]:
        """fact_id -> entry or None for `fact_ids`, from the copy at `generation`, looking up what it lacks (read
        after the generation was: an entry the lookup sees is at least as new as the label)."""
        owner = (profile_id, user_id)
        known = self._serving_copy.known(owner, generation, fact_ids)
        lacking = [fact for fact in dict.fromkeys(fact_ids) if fact not in known]
        if lacking:
            found = self.entries(profile_id, user_id, lacking)
            looked_up = {fact: found.get(fact) for fact in lacking}
            self._serving_copy.learn(owner, generation, looked_up)
            known.update(looked_up)
        return {fact: known[fact] for fact in fact_ids}

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
