"""LanceDB-backed storage of users' facts (with embeddings) and conversation turns, in a local directory or on an
object store shared by service replicas (memory_service.object_store.StoreLocation). Writes follow the per-user
write protocol (memory_service.user_writes), which also keeps the search cache that searches are answered from.

Every method takes validated input (see validation.py): ids come from a quote-free alphabet, which
is what makes the SQL filters below safe to build by formatting.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta

import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from lancedb.index import BTree

from memory_service.blocking import run_blocking
from memory_service.coordination.store_meta import StoreMeta
from memory_service.errors import LimitExceeded
from memory_service.models import (
    IngestOutcome,
    IngestResult,
    NewFact,
    NewTurn,
    ScoredFact,
    StoreCounts,
    StoredFact,
    StoredTurn,
)
from memory_service.object_store import StoreLocation
from memory_service.retrieval import SCORE_DECIMALS, rank_key
from memory_service.steps import step_done
from memory_service.user_facts import FACT_ROW_COLUMNS, UserFacts, fact_row, keyword_index, keyword_ranked, stored_fact
from memory_service.user_writes import UserWrites, WriteTicket

log = structlog.get_logger(__name__)

FACTS_TABLE = "facts"
TURNS_TABLE = "turns"
EMBEDDING_META = "embedding"  # the store_meta entry naming the embedding model and dimension


class StoreMismatch(RuntimeError):
    """The data directory was written with another embedding model or dimension."""


def _is_commit_conflict(error: Exception) -> bool:
    """Lance's report that a concurrent commit (another replica's, a compaction) preempted this one, which then
    wrote nothing. Lance retries appends, merges and deletes itself; index builds and compactions it reports."""
    return "Retryable commit conflict for version" in str(error)


async def _indexed_columns(table: lancedb.table.AsyncTable) -> set[str]:
    return {column for index in await table.list_indices() for column in index.columns}


def _sql_list(values: Sequence[str]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def _now_us() -> int:
    return time.time_ns() // 1000


def row_key(user_id: str, item_id: str) -> str:
    """The single-column primary key LanceDB needs (it has no compound keys); '|' is not an id character."""
    return f"{user_id}|{item_id}"


def facts_schema(dim: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("key", pa.string(), nullable=False),
            pa.field("user_id", pa.string(), nullable=False),
            pa.field("fact_id", pa.string(), nullable=False),
            pa.field("text", pa.string(), nullable=False),
            pa.field("source_turn_id", pa.string(), nullable=False),
            pa.field("timestamp_us", pa.int64(), nullable=False),
            pa.field("metadata_json", pa.string(), nullable=False),
            pa.field("content_hash", pa.string(), nullable=False),
            pa.field("version", pa.int64(), nullable=False),
            pa.field("created_at_us", pa.int64(), nullable=False),
            pa.field("updated_at_us", pa.int64(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), dim), nullable=False),
        ]
    )


TURNS_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("turn_id", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("speaker", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("timestamp_us", pa.int64(), nullable=False),
    ]
)

Embed = Callable[[list[str]], Awaitable[np.ndarray]]
"""Embeds texts into unit vectors, one row per text."""


def _stored_fact(row: dict) -> StoredFact:
    """The StoredFact of a LanceDB row selected with FACT_ROW_COLUMNS."""
    return stored_fact(fact_row(row))


class FactStore:
    """Facts and turns of all users in two LanceDB tables keyed by (user_id, fact_id|turn_id).

    Writes follow the per-user write protocol (`user_writes`) and are committed one at a time per process; reads run
    concurrently. Acknowledged writes are committed to the store. `open` before use.
    """

    def __init__(self, location: StoreLocation, user_writes: UserWrites, store_meta: StoreMeta, embedding_model: str,
                 embedding_dim: int, lancedb_cache_bytes: int = 128 << 20) -> None:
        self._location = location
        self._user_writes = user_writes
        self._store_meta = store_meta
        self._embedding_model = embedding_model
        self._dim = embedding_dim
        self._facts: lancedb.table.AsyncTable | None = None
        self._turns: lancedb.table.AsyncTable | None = None
        self._commit_lock = asyncio.Lock()
        self._writes_since_optimize = 0
        self._user_indexed_tables: set[str] = set()
        # Bounded: LanceDB's defaults keep a manifest per table version, and every write makes one.
        self._lancedb_session = lancedb.Session(index_cache_size_bytes=lancedb_cache_bytes // 2,
                                                metadata_cache_size_bytes=lancedb_cache_bytes // 2)

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Opens (or creates) the tables; raises StoreMismatch for a store of another embedding model."""
        await run_blocking(self._check_store_meta)
        if self._location.local_dir is not None:
            self._location.local_dir.mkdir(parents=True, exist_ok=True)
        # Replicas sharing the store see each other's commits: every read checks for a newer table version.
        db = await lancedb.connect_async(self._location.lancedb_uri, storage_options=self._location.lancedb_options,
                                         read_consistency_interval=timedelta(0) if self._user_writes.shared else None,
                                         session=self._lancedb_session)
        existing = set((await db.list_tables()).tables)
        self._facts = await self._open_or_create(db, FACTS_TABLE, facts_schema(self._dim), existing)
        self._turns = await self._open_or_create(db, TURNS_TABLE, TURNS_SCHEMA, existing)
        for table in (self._facts, self._turns):
            await self._ensure_user_index(table)

    def _check_store_meta(self) -> None:
        """Refuses a store written with another embedding model or dimension."""
        wanted = {"embedding_model": self._embedding_model, "embedding_dim": self._dim}
        recorded = json.loads(self._store_meta.claim(EMBEDDING_META, json.dumps(wanted, sort_keys=True)))
        if recorded != wanted:
            raise StoreMismatch(
                f"{self._location.describe()} holds embeddings of {recorded}, not {wanted}: use another store "
                "(--data-dir, --store-uri) or the same --embedding-model")

    @staticmethod
    async def _open_or_create(
        db: lancedb.AsyncConnection, name: str, schema: pa.Schema, existing: set[str]
    ) -> lancedb.table.AsyncTable:
        if name in existing:
            return await db.open_table(name)
        try:
            table = await db.create_table(name, schema=schema)
        except ValueError:  # another replica starting beside this one created it first
            return await db.open_table(name)
        # Concurrent upserts of the same new key then retry on conflict instead of duplicating.
        await table.set_unenforced_primary_key("key")
        return table

    async def _ensure_user_index(self, table: lancedb.table.AsyncTable) -> None:
        """A BTREE on user_id makes per-user prefiltering O(user's rows); built once the table has rows.

        Rows written after the index was built are scanned (still exact) until `optimize` folds them in.
        """
        if table.name in self._user_indexed_tables:
            return
        indexed = await _indexed_columns(table)
        if "user_id" not in indexed and await table.count_rows() > 0:
            try:
                await table.create_index("user_id", config=BTree())
            except RuntimeError as error:
                if not _is_commit_conflict(error):
                    raise
                # Another replica's index or compaction committed first: the index is its, or the next write's.
                await table.checkout_latest()
                indexed = await _indexed_columns(table)
            else:
                indexed.add("user_id")
        if "user_id" in indexed:
            self._user_indexed_tables.add(table.name)

    async def optimize(self) -> bool:
        """Compacts small write fragments and folds new rows into the user index. A compaction preempted
        by a concurrent write (another replica's) is left to the next call. Returns whether every table was compacted;
        writes committed while it ran still count towards the next call."""
        writes = self._writes_since_optimize
        preempted = False
        for table in (self._facts_table, self._turns_table):
            await self._ensure_user_index(table)
            try:
                await table.optimize()
            except RuntimeError as error:
                if not _is_commit_conflict(error):
                    raise
                preempted = True
                log.info("store_optimize_preempted", table=table.name, reason=str(error).split(",")[0])
        if not preempted:
            self._writes_since_optimize -= writes
        return not preempted

    @property
    def writes_since_optimize(self) -> int:
        return self._writes_since_optimize

    @property
    def _facts_table(self) -> lancedb.table.AsyncTable:
        assert self._facts is not None, "FactStore.open() was not awaited"
        return self._facts

    @property
    def _turns_table(self) -> lancedb.table.AsyncTable:
        assert self._turns is not None, "FactStore.open() was not awaited"
        return self._turns

    async def _commit(self, table: lancedb.table.AsyncTable, rows: pa.Table, all_new: bool = False) -> None:
        """Upserts `rows` by key. `all_new`: the caller checked, under the user's write lock, that no key exists,
        so the rows are appended instead of merged (a merge joins the rows with the whole table)."""
        async with self._commit_lock:
            if all_new:
                await table.add(rows)
            else:
                await table.merge_insert("key").when_matched_update_all().when_not_matched_insert_all().execute(rows)
            self._writes_since_optimize += 1
            try:
                await self._ensure_user_index(table)
            except Exception:  # the write committed; the index is the next write's or optimize's
                log.exception("user_index_deferred", table=table.name)

    # ------------------------------------------------------------------ facts

    async def _existing_fact_versions(self, user_id: str, fact_ids: Sequence[str],
                                      ticket: WriteTicket) -> dict[str, tuple[str, int, int]]:
        """fact_id -> (content_hash, version, created_at_us) for the ids the user has: from the user's cached facts
        when cached and current as of the write (callers hold the user's write lock), else from LanceDB (a filtered
        scan, which takes its CPU from concurrent queries)."""
        cached = self._user_writes.current_copy(user_id, ticket)
        if cached is not None:
            return cached.versions(set(fact_ids))
        rows = await (
            self._facts_table.query()
            .where(f"user_id = '{user_id}' AND fact_id IN ({_sql_list(fact_ids)})")
            .select(["fact_id", "content_hash", "version", "created_at_us"])
            .to_list()
        )
        return {row["fact_id"]: (row["content_hash"], row["version"], row["created_at_us"]) for row in rows}

    async def ingest_facts(self, user_id: str, facts: Sequence[NewFact], embed: Embed,
                           max_facts_per_user: int | None = None,
                           tenant_quota: tuple[str, int] | None = None) -> list[IngestResult]:
        """Creates new facts, bumps the version of changed ones, leaves identical ones alone.

        Only new or changed facts are embedded (`embed`).
        Raises LimitExceeded, storing nothing, when the new facts would take the user past `max_facts_per_user`, or
        the users under `tenant_quota`'s prefix past its fact count (checked per call under the user's lock: calls
        for different users of one tenant racing each other can overshoot it by one batch each).
        """
        async with self._user_writes.write(user_id) as ticket:
            existing = await self._existing_fact_versions(user_id, [fact.fact_id for fact in facts], ticket)
            results: list[IngestResult] = []
            to_write: list[tuple[NewFact, int, int]] = []
            now = _now_us()
            first_version = None
            for fact in facts:
                previous = existing.get(fact.fact_id)
                if previous is None:
                    if first_version is None:
                        first_version = await self._user_writes.first_version(user_id)
                    results.append(IngestResult(fact.fact_id, first_version, IngestOutcome.CREATED))
                    to_write.append((fact, first_version, now))
                elif previous[0] == fact.content_hash:
                    results.append(IngestResult(fact.fact_id, previous[1], IngestOutcome.UNCHANGED))
                else:
                    results.append(IngestResult(fact.fact_id, previous[1] + 1, IngestOutcome.UPDATED))
                    to_write.append((fact, previous[1] + 1, previous[2]))
            created = sum(1 for result in results if result.outcome is IngestOutcome.CREATED)
            if created and max_facts_per_user is not None:
                await self._refuse_past_quota(f"user_id = '{user_id}'", created, f"user {user_id!r} holds",
                                              max_facts_per_user, "the limit of {} per user")
            if created and tenant_quota is not None:
                prefix, max_facts = tenant_quota
                await self._refuse_past_quota(f"starts_with(user_id, '{prefix}')", created,
                                              f"the users under {prefix!r} hold", max_facts, "the tenant's quota of {}")
            step_done("check")
            if to_write:
                vectors: np.ndarray = await embed([fact.text for fact, _, _ in to_write])
                step_done("embed")
                records = [
                    {
                        "key": row_key(user_id, fact.fact_id),
                        "user_id": user_id,
                        "fact_id": fact.fact_id,
                        "text": fact.text,
                        "source_turn_id": fact.source_turn_id,
                        "timestamp_us": fact.timestamp_us,
                        "metadata_json": json.dumps(fact.metadata, ensure_ascii=False, sort_keys=True),
                        "content_hash": fact.content_hash,
                        "version": version,
                        "created_at_us": created_at_us,
                        "updated_at_us": now,
                        "vector": vector,
                    }
                    for (fact, version, created_at_us), vector in zip(to_write, vectors, strict=True)
                ]
                await self._commit(self._facts_table, pa.Table.from_pylist(records, schema=facts_schema(self._dim)),
                                   all_new=len(to_write) == created)
                self._user_writes.committed(user_id, [fact_row(record) for record in records], vectors, ticket)
            return results

    async def _refuse_past_quota(self, condition: str, created: int, holder: str, limit: int, limit_text: str) -> None:
        """Raises LimitExceeded when the facts matching `condition` plus `created` new ones exceed `limit`."""
        held = await self._facts_table.count_rows(condition)
        if held + created > limit:
            raise LimitExceeded("facts", f"{holder} {held} facts; {created} more would pass {limit_text.format(limit)}")

    async def search(self, user_id: str, query_vector: np.ndarray, top_k: int) -> list[ScoredFact]:
        """Exact cosine top-k over the user's facts, best first, ties by fact_id: from the user's cached fact matrix,
        loaded from LanceDB on a miss; users too large for the cache are searched in LanceDB (prefiltered by user),
        taking every fact tied with the k-th, since which of them LanceDB's limit keeps follows its row order."""
        cached = await self._user_writes.read(user_id, self._user_facts)
        if cached is not None:
            return cached.top_k(query_vector, top_k)
        condition = f"user_id = '{user_id}'"

        def nearest() -> lancedb.query.AsyncVectorQuery:
            return (self._facts_table.vector_search(query_vector.astype(np.float32)).distance_type("cosine")
                    .where(condition).select([*FACT_ROW_COLUMNS, "_distance"]))

        rows = await nearest().limit(top_k).to_list()
        if len(rows) == top_k:
            kth = max(float(row["_distance"]) for row in rows)
            rows = await (nearest().distance_range(upper_bound=kth + 2 * 10.0 ** -SCORE_DECIMALS)
                          .limit(await self._facts_table.count_rows(condition)).to_list())
        scored = [ScoredFact(fact=_stored_fact(row), score=1.0 - float(row["_distance"])) for row in rows]
        return sorted(scored, key=lambda result: rank_key(result.score, result.fact.fact_id))[:top_k]

    async def keyword_search(self, user_id: str, text: str, top_k: int) -> list[ScoredFact]:
        """The user's top-k facts by BM25 of `text` against their text, best first, ties by fact_id; facts sharing
        no word with it are not returned. BM25 over the user's facts alone (memory_service.keywords): from the
        user's cached facts and their index; users too large for the cache are read whole from LanceDB and indexed
        for the query."""
        cached = await self._user_writes.read(user_id, self._user_facts)
        if cached is not None:
            return await run_blocking(cached.keyword_top_k, text, top_k)
        table = await self._facts_table.query().where(f"user_id = '{user_id}'").select(
            list(FACT_ROW_COLUMNS)).to_arrow()
        rows = list(zip(*(table.column(column).to_pylist() for column in FACT_ROW_COLUMNS), strict=True))
        return await run_blocking(lambda: keyword_ranked(rows, keyword_index(rows), text, top_k))

    async def _user_facts(self, user_id: str, store_generation: int) -> UserFacts:
        """The user's facts as LanceDB has them now, labelled `store_generation` (user_writes.UserFactsRead)."""
        table = await self._facts_table.query().where(f"user_id = '{user_id}'").select(
            [*FACT_ROW_COLUMNS, "vector"]).to_arrow()
        # One numpy copy, nothing in Arrow's memory pool: a cached matrix lives as long as its user's entry and is
        # replaced by numpy arrays on the user's writes, so holding it in Arrow's pool too would keep both
        # allocators' pages.
        chunks = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in table.column("vector").chunks]
        vectors = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.float32)
        rows = list(zip(*(table.column(column).to_pylist() for column in FACT_ROW_COLUMNS), strict=True))
        return UserFacts(rows, vectors.astype(np.float32, copy=False).reshape(len(rows), self._dim), store_generation)

    async def list_facts(self, user_id: str, after_fact_id: str, page_size: int) -> tuple[list[StoredFact], bool]:
        """One page of the user's facts in fact_id order after `after_fact_id`, and whether more follow."""
        condition = f"user_id = '{user_id}'" + (f" AND fact_id > '{after_fact_id}'" if after_fact_id else "")
        ids = await self._facts_table.query().where(condition).select(["fact_id"]).to_arrow()
        ordered = sorted(ids.column("fact_id").to_pylist())
        page_ids = ordered[:page_size]
        if not page_ids:
            return [], False
        rows = await (
            self._facts_table.query()
            .where(f"user_id = '{user_id}' AND fact_id IN ({_sql_list(page_ids)})")
            .select(list(FACT_ROW_COLUMNS))
            .to_list()
        )
        facts = sorted((_stored_fact(row) for row in rows), key=lambda fact: fact.fact_id)
        return facts, len(ordered) > page_size

    async def delete_facts(self, user_id: str, fact_ids: Sequence[str]) -> list[str]:
        """Deletes the given facts; returns the ids that existed."""
        async with self._user_writes.write(user_id) as ticket:
            versions = await self._existing_fact_versions(user_id, fact_ids, ticket)
            found = list(versions)
            if found:
                await self._user_writes.retire_versions(user_id, max(version for _, version, _ in versions.values()))
                async with self._commit_lock:
                    await self._facts_table.delete(f"user_id = '{user_id}' AND fact_id IN ({_sql_list(found)})")
                    self._writes_since_optimize += 1
                self._user_writes.dropped(user_id)
            return found

    async def delete_user(self, user_id: str) -> tuple[int, int]:
        """Deletes all of a user's facts and turns; returns (facts, turns) deleted."""
        condition = f"user_id = '{user_id}'"
        async with self._user_writes.write(user_id):
            facts = await self._facts_table.count_rows(condition)
            turns = await self._turns_table.count_rows(condition)
            if facts:
                versions = await self._facts_table.query().where(condition).select(["version"]).to_arrow()
                await self._user_writes.retire_versions(user_id, pc.max(versions.column("version")).as_py())
            async with self._commit_lock:
                if facts:
                    await self._facts_table.delete(condition)
                if turns:
                    await self._turns_table.delete(condition)
                self._writes_since_optimize += 1
            self._user_writes.dropped(user_id)
            return facts, turns

    async def fact_versions(self) -> list[tuple[str, str, int]]:
        """(user_id, fact_id, version) of every stored fact."""
        table = await self._facts_table.query().select(["user_id", "fact_id", "version"]).to_arrow()
        return list(zip(*(table.column(name).to_pylist() for name in ("user_id", "fact_id", "version")), strict=True))

    async def facts_by_ids(self, user_id: str, fact_ids: Sequence[str]) -> dict[str, StoredFact]:
        if not fact_ids:
            return {}
        rows = await (
            self._facts_table.query()
            .where(f"user_id = '{user_id}' AND fact_id IN ({_sql_list(fact_ids)})")
            .select(list(FACT_ROW_COLUMNS))
            .to_list()
        )
        return {row["fact_id"]: _stored_fact(row) for row in rows}

    # ------------------------------------------------------------------ turns

    async def turns_of_user(self, user_id: str) -> list[StoredTurn]:
        """The user's turns in chronological order (seq, then turn_id)."""
        rows = await self._turns_table.query().where(f"user_id = '{user_id}'").select(
            ["turn_id", "seq", "session_id", "speaker", "text", "timestamp_us"]).to_list()
        turns = [StoredTurn(**row) for row in rows]
        return sorted(turns, key=lambda turn: (turn.seq, turn.turn_id))

    async def ingest_turns(self, user_id: str, turns: Sequence[NewTurn]) -> int:
        rows = pa.Table.from_pylist(
            [
                {
                    "key": row_key(user_id, turn.turn_id),
                    "user_id": user_id,
                    "turn_id": turn.turn_id,
                    "seq": turn.seq,
                    "session_id": turn.session_id,
                    "speaker": turn.speaker,
                    "text": turn.text,
                    "timestamp_us": turn.timestamp_us,
                }
                for turn in turns
            ],
            schema=TURNS_SCHEMA,
        )
        async with self._user_writes.write(user_id, changes_facts=False):
            await self._commit(self._turns_table, rows)
        return len(turns)

    # ------------------------------------------------------------------ stats

    async def row_counts(self) -> tuple[int, int]:
        """(facts, turns) stored for all users; cheap (table metadata only)."""
        return await self._facts_table.count_rows(), await self._turns_table.count_rows()

    async def counts(self, user_id: str = "") -> StoreCounts:
        condition = f"user_id = '{user_id}'" if user_id else None
        facts = await self._facts_table.count_rows(condition)
        turns = await self._turns_table.count_rows(condition)
        if user_id:
            return StoreCounts(users=int(bool(facts or turns)), facts=facts, turns=turns)
        users: set[str] = set()
        for table in (self._facts_table, self._turns_table):
            column = (await table.query().select(["user_id"]).to_arrow()).column("user_id")
            users.update(pc.unique(column).to_pylist())
        return StoreCounts(users=len(users), facts=facts, turns=turns)
