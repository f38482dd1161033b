"""FactStore on a real LanceDB: concurrent searches of a user not yet cached share one read, a search that starts
after a write never gets a read made before it, and ingest's check of which facts exist (answered by the search
cache for cached users) neither duplicates nor misses a fact, also after a write that failed."""

from __future__ import annotations

import asyncio

import lancedb
import numpy as np
import pyarrow as pa
import pytest
from lancedb.index import BTree

from memory_service.coordination import Coordination
from memory_service.fact_store import FactStore, facts_schema
from memory_service.models import IngestOutcome, NewFact
from memory_service.object_store import S3Settings, StoreLocation
from memory_service.sql import SqliteDatabase
from memory_service.user_facts import FACT_ROW_COLUMNS
from memory_service.user_writes import UserWrites

DIM = 4


async def _axis_embed(texts: list[str]) -> np.ndarray:
    """Fact "axis-i ..." embeds to the unit vector e_i: rankings known in advance."""
    vectors = np.zeros((len(texts), DIM), dtype=np.float32)
    for row, text in enumerate(texts):
        vectors[row, int(text.split()[0].removeprefix("axis-"))] = 1.0
    return vectors


def _local_store(data_dir, lancedb_cache_bytes: int = 128 << 20) -> FactStore:
    coordination = Coordination.open(SqliteDatabase(data_dir / "kv" / "index.sqlite"))
    user_writes = UserWrites(coordination.user_records, shared=False, search_cache_bytes=256 << 20)
    return FactStore(StoreLocation.parse("", data_dir, S3Settings()), user_writes, coordination.store_meta,
                     "test-embedder", DIM, lancedb_cache_bytes=lancedb_cache_bytes)


def _query(axis: int) -> np.ndarray:
    return np.eye(DIM, dtype=np.float32)[axis]


async def _store_with_facts(tmp_path) -> tuple[FactStore, list[int]]:
    store = _local_store(tmp_path)
    await store.open()
    await store.ingest_facts("u", [NewFact(f"f{i}", f"axis-{i} fact") for i in range(3)], _axis_embed)
    store._user_writes.search_cache.invalidate("u")  # cold, as after a restart
    reads: list[int] = []
    real_read = store._user_facts

    async def counted_read(user_id: str, store_generation: int):
        reads.append(1)
        await asyncio.sleep(0.05)  # a read slow enough for the other searches to arrive while it runs
        return await real_read(user_id, store_generation)

    store._user_facts = counted_read
    return store, reads


async def test_concurrent_searches_of_an_uncached_user_share_one_lancedb_read(tmp_path) -> None:
    store, reads = await _store_with_facts(tmp_path)
    results = await asyncio.gather(*(store.search("u", _query(i % 3), 1) for i in range(30)))
    assert len(reads) == 1
    assert [r[0].fact.fact_id for r in results] == [f"f{i % 3}" for i in range(30)]
    await store.search("u", _query(0), 1)
    assert len(reads) == 1  # installed in the cache


async def test_a_search_after_a_write_does_not_join_a_read_started_before_it(tmp_path) -> None:
    store, reads = await _store_with_facts(tmp_path)
    counted_read, first_read_may_end = store._user_facts, asyncio.Event()

    async def read_held_until_the_write_is_done(user_id: str, store_generation: int):
        if not reads:  # the early search's read stays in flight until the write below has committed
            reads.append(1)
            await first_read_may_end.wait()
            reads.pop()
        return await counted_read(user_id, store_generation)

    store._user_facts = read_held_until_the_write_is_done
    early = asyncio.ensure_future(store.search("u", _query(3), 1))
    while not reads:
        await asyncio.sleep(0.001)
    await store.ingest_facts("u", [NewFact("f3", "axis-3 written during the read")], _axis_embed)
    late = asyncio.ensure_future(store.search("u", _query(3), 1))
    await asyncio.sleep(0.01)
    first_read_may_end.set()
    assert (await late)[0].fact.fact_id == "f3"
    assert len(reads) == 2
    await early


async def test_a_cancelled_search_leaves_the_shared_read_to_the_others(tmp_path) -> None:
    store, reads = await _store_with_facts(tmp_path)
    first = asyncio.ensure_future(store.search("u", _query(1), 1))
    second = asyncio.ensure_future(store.search("u", _query(2), 1))
    await asyncio.sleep(0.01)
    first.cancel()
    assert (await second)[0].fact.fact_id == "f2"
    assert len(reads) == 1


def test_a_cached_row_holds_every_stored_column_but_the_key_and_the_vector() -> None:
    assert sorted(FACT_ROW_COLUMNS) == sorted(set(facts_schema(1).names) - {"key", "vector"})


async def _cached_store(tmp_path) -> FactStore:
    store = _local_store(tmp_path)
    await store.open()
    await store.ingest_facts("u", [NewFact(f"f{i}", f"axis-{i} fact") for i in range(2)], _axis_embed)
    await store.search("u", _query(0), 1)
    assert store._user_writes.search_cache.get("u") is not None
    return store


async def test_ingest_for_a_cached_user_tells_created_updated_and_unchanged_apart_without_duplicates(tmp_path) -> None:
    store = await _cached_store(tmp_path)
    results = await store.ingest_facts("u", [NewFact("f0", "axis-0 fact"), NewFact("f1", "axis-1 changed"),
                                             NewFact("f2", "axis-2 new")], _axis_embed)
    assert [(r.fact_id, r.version, r.outcome) for r in results] == [
        ("f0", 1, IngestOutcome.UNCHANGED), ("f1", 2, IngestOutcome.UPDATED), ("f2", 1, IngestOutcome.CREATED)]
    assert await store._facts_table.count_rows() == 3
    store._user_writes.search_cache.invalidate("u")  # LanceDB, read afresh, agrees with what the cache answered
    assert {f.fact_id: (f.version, f.text) for f in [r.fact for r in await store.search("u", _query(1), 3)]} == {
        "f0": (1, "axis-0 fact"), "f1": (2, "axis-1 changed"), "f2": (1, "axis-2 new")}


async def test_a_write_that_fails_after_committing_drops_the_cache_so_its_retry_is_not_duplicated(tmp_path) -> None:
    store = await _cached_store(tmp_path)
    real_commit = store._commit

    async def commit_then_fail(*args, **kwargs) -> None:
        await real_commit(*args, **kwargs)
        raise OSError("connection lost after the commit")

    store._commit = commit_then_fail
    with pytest.raises(OSError):
        await store.ingest_facts("u", [NewFact("f2", "axis-2 new")], _axis_embed)
    store._commit = real_commit
    assert store._user_writes.search_cache.get("u") is None
    retried = await store.ingest_facts("u", [NewFact("f2", "axis-2 new")], _axis_embed)
    assert [(r.version, r.outcome) for r in retried] == [(1, IngestOutcome.UNCHANGED)]
    assert await store._facts_table.count_rows() == 3


async def test_a_user_index_built_by_another_writer_first_does_not_fail_this_ones_write(tmp_path) -> None:
    """Replicas build the user_id index after their first write to a table; two at once conflict in LanceDB. The
    loser's write committed already and must not be reported as failed (CI saw IngestFacts answer INTERNAL)."""
    store = _local_store(tmp_path)
    await store.open()
    rows = [{"key": f"other|f{i}", "user_id": "other", "fact_id": f"f{i}", "text": "t", "source_turn_id": "",
             "timestamp_us": 0, "metadata_json": "{}", "content_hash": "h", "version": 1, "created_at_us": 0,
             "updated_at_us": 0, "vector": [0.0] * DIM} for i in range(2)]
    facts = store._facts_table
    await facts.add(pa.Table.from_pylist(rows, schema=facts_schema(DIM)))
    other_replica = await (await lancedb.connect_async(str(tmp_path / "lancedb"))).open_table("facts")
    await other_replica.create_index("user_id", config=BTree())

    await store._ensure_user_index(facts)  # this replica's view predates the other's index

    # One user index: the other replica's.
    assert sorted(index.columns for index in await facts.list_indices()) == [["user_id"]]
    await store.ingest_facts("u", [NewFact("f0", "axis-0 fact")], _axis_embed)
    assert sorted(index.columns for index in await facts.list_indices()) == [["user_id"]]


async def test_a_compaction_preempted_by_another_writers_delete_is_left_for_later(tmp_path) -> None:
    store = _local_store(tmp_path)
    await store.open()
    for i in range(3):  # three fragments, for compaction to merge
        await store.ingest_facts("u", [NewFact(f"f{i}", f"axis-{i} fact")], _axis_embed)
    other_replica = await (await lancedb.connect_async(str(tmp_path / "lancedb"))).open_table("facts")
    await other_replica.delete("fact_id = 'f1'")

    await store.optimize()  # this replica's view predates the other's delete

    assert store.writes_since_optimize > 0  # the next round compacts
    await store._facts_table.checkout_latest()
    await store.optimize()
    assert store.writes_since_optimize == 0
    assert sorted(row["fact_id"] for row in await store._facts_table.query().to_list()) == ["f0", "f2"]


async def test_lancedbs_caches_stay_within_their_budget_as_writes_add_table_versions(tmp_path) -> None:
    """Every write is a table version; LanceDB's default caches kept each one's manifest (the full load test grew
    ~150 MiB a minute under steady ingest)."""
    store = _local_store(tmp_path, lancedb_cache_bytes=1 << 20)
    await store.open()
    for write in range(150):
        await store.ingest_facts(f"u{write % 10}", [NewFact(f"f{write}", f"axis-{write % DIM} fact")], _axis_embed)
        await store.search(f"u{write % 10}", _query(write % DIM), 1)
    assert store._lancedb_session.size_bytes <= 1 << 20


async def test_a_users_cached_fact_matrix_holds_nothing_in_arrows_memory_pool(tmp_path) -> None:
    """Cached matrices are replaced by numpy arrays on every write to their user; one read from LanceDB and kept in
    Arrow's pool would hold pages in two allocators (the full load test's resident size crept with ingest)."""
    store = _local_store(tmp_path)
    await store.open()
    await store.ingest_facts("u", [NewFact(f"f{i}", f"axis-{i % DIM} fact") for i in range(2000)], _axis_embed)
    store._user_writes.search_cache.invalidate("u")
    pooled = pa.total_allocated_bytes()
    await store.search("u", _query(0), 1)
    cached = store._user_writes.search_cache.get("u")
    assert cached is not None and cached.vectors.nbytes == 2000 * DIM * 4
    assert pa.total_allocated_bytes() - pooled < cached.vectors.nbytes


async def test_keyword_search_finds_new_facts_before_compaction_and_after_and_a_deleted_one_never(tmp_path) -> None:
    store = _local_store(tmp_path)
    await store.open()
    await store.ingest_facts("u", [NewFact("f0", "axis-0 Nora plants tulips"), NewFact("f1", "axis-1 Ben fixes bikes")],
                             _axis_embed)
    await store.ingest_facts("v", [NewFact("f0", "axis-2 Vera grows tulips")], _axis_embed)
    found = [scored.fact.fact_id for scored in await store.keyword_search("u", "tulips", 10)]
    assert found == ["f0"]  # the other user's tulips are not
    assert await store.optimize()
    assert [scored.fact.fact_id for scored in await store.keyword_search("u", "tulips", 10)] == ["f0"]
    await store.delete_facts("u", ["f0"])
    assert await store.keyword_search("u", "tulips", 10) == []


async def test_a_question_in_double_quotes_is_words_to_search_not_a_phrase_query_that_fails(tmp_path) -> None:
    """A user's question is always words: LanceDB's full-text search read a quoted one as a phrase query, which its
    index refused (the call ended INTERNAL)."""
    store = _local_store(tmp_path)
    await store.open()
    await store.ingest_facts("u", [NewFact("f0", "axis-0 the parcel went to Lisbon")], _axis_embed)
    assert await store.optimize()
    for question in ('"Where is my parcel?"', '"parcel"', 'Where is my "parcel"?'):
        assert [scored.fact.fact_id for scored in await store.keyword_search("u", question, 5)] == ["f0"], question

