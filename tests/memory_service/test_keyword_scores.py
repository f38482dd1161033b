"""Keyword scores and ranks depend only on the user's own facts: another user's facts with the query's words, and
compaction, change neither; facts that tie are ranked by fact_id in every mode, also where the top-k cut falls among
them; words match by their stems. For users answered from the search cache and for users too large for it (read from
LanceDB per query)."""

from __future__ import annotations

import string

import numpy as np
import pytest

from memory_service.coordination import Coordination
from memory_service.fact_store import FactStore
from memory_service.models import NewFact, ScoredFact
from memory_service.object_store import S3Settings, StoreLocation
from memory_service.retrieval import candidates, fuse
from memory_service.sql import SqliteDatabase
from memory_service.user_writes import UserWrites

DIM = 4
CACHE = {"cached": 256 << 20, "uncached": 0}


async def _embed(texts: list[str]) -> np.ndarray:
    """Every text embeds to the same unit vector: vector scores tie exactly."""
    return np.tile(np.eye(DIM, dtype=np.float32)[0], (len(texts), 1))


async def _open_store(data_dir, search_cache_bytes: int) -> FactStore:
    coordination = Coordination.open(SqliteDatabase(data_dir / "kv" / "index.sqlite"))
    user_writes = UserWrites(coordination.user_records, shared=False, search_cache_bytes=search_cache_bytes)
    store = FactStore(StoreLocation.parse("", data_dir, S3Settings()), user_writes, coordination.store_meta,
                      "test-embedder", DIM)
    await store.open()
    return store


def _scored(results: list[ScoredFact]) -> list[tuple[str, float]]:
    return [(scored.fact.fact_id, scored.score) for scored in results]


async def _ranked(store: FactStore, user_id: str, query: str, mode: str, top_k: int) -> list[str]:
    query_vector = np.eye(DIM, dtype=np.float32)[0]
    if mode == "vector":
        results = await store.search(user_id, query_vector, top_k)
    elif mode == "keyword":
        results = await store.keyword_search(user_id, query, top_k)
    else:  # as operations.py fuses them
        depth = candidates(top_k)
        results = fuse(await store.search(user_id, query_vector, depth),
                       await store.keyword_search(user_id, query, depth), query, top_k)
    return [scored.fact.fact_id for scored in results]


@pytest.mark.parametrize("cache", CACHE)
async def test_a_users_keyword_scores_do_not_change_when_another_user_stores_the_querys_words(tmp_path, cache) -> None:
    store = await _open_store(tmp_path, CACHE[cache])
    await store.ingest_facts("a", [NewFact("pets", "Nora adopted a kitten and a puppy"),
                                   NewFact("garden", "Nora plants tulips in spring"),
                                   NewFact("both", "The kitten sleeps among the tulips")], _embed)
    assert await store.optimize()
    query = "kitten tulips"
    before = _scored(await store.keyword_search("a", query, 10))
    assert [fact_id for fact_id, _ in before] == ["both", "garden", "pets"]
    await store.ingest_facts("b", [NewFact(f"b{i}", f"kitten number {i} among tulips") for i in range(300)], _embed)
    assert _scored(await store.keyword_search("a", query, 10)) == before
    assert await store.optimize()
    assert _scored(await store.keyword_search("a", query, 10)) == before


@pytest.mark.parametrize("cache", CACHE)
async def test_tied_facts_are_cut_by_fact_id_in_every_mode_before_and_after_compaction(tmp_path, cache) -> None:
    store = await _open_store(tmp_path, CACHE[cache])
    for fact_id in reversed(string.ascii_lowercase):  # z first: LanceDB's row order is the reverse of fact_id order
        await store.ingest_facts("u", [NewFact(fact_id, "Ana grows tomatoes on her balcony.")], _embed)
    for _ in ("before", "after"):
        for mode in ("vector", "keyword", "hybrid"):
            assert await _ranked(store, "u", "tomatoes on the balcony", mode, 3) == ["a", "b", "c"], mode
        assert await store.optimize()


@pytest.mark.parametrize("cache", CACHE)
async def test_a_fact_sharing_only_a_stem_with_the_query_is_found_where_vector_search_misses_it(tmp_path,
                                                                                                 cache) -> None:
    store = await _open_store(tmp_path, CACHE[cache])
    await store.ingest_facts("u", [NewFact("a-pets", "Nora adopted two kittens"),
                                   NewFact("b-garden", "Nora plants tulips in spring"),
                                   NewFact("z-alps", "Nora hikes in the Alps every summer")], _embed)
    query = "Where did Nora go hiking?"  # "hiking" and "hikes" share the stem "hike"
    assert await _ranked(store, "u", query, "vector", 1) == ["a-pets"]  # every vector ties: fact_id decides
    assert await _ranked(store, "u", query, "keyword", 1) == ["z-alps"]
    assert await _ranked(store, "u", query, "hybrid", 1) == ["z-alps"]


def test_one_users_keyword_index_build_does_not_hold_up_anothers(monkeypatch) -> None:
    """A user's first keyword query builds the user's index; another user's build, however long, does not wait for
    it (functools.cached_property's lock, one for every instance on Python 3.11, made it wait)."""
    import threading

    from memory_service import user_facts
    from memory_service.user_facts import UserFacts, fact_row

    def facts(user: str, count: int) -> UserFacts:
        rows = [fact_row({"user_id": user, "fact_id": f"f{i}", "text": f"jar {i} on shelf", "source_turn_id": "",
                          "timestamp_us": 0, "metadata_json": "{}", "version": 1, "created_at_us": 0,
                          "updated_at_us": 0, "content_hash": ""}) for i in range(count)]
        return UserFacts(rows, np.zeros((count, 4), dtype=np.float32))

    big, small = facts("big", 3), facts("small", 2)
    building, small_built = threading.Event(), threading.Event()
    waited: list[bool] = []
    real_build = user_facts.keyword_index

    def build(rows):
        if rows is big.rows:  # a long build: it lasts until the small user's index is built, or 5 s
            building.set()
            waited.append(small_built.wait(timeout=5))
        return real_build(rows)

    monkeypatch.setattr(user_facts, "keyword_index", build)
    builder = threading.Thread(target=lambda: big.keyword_index)
    builder.start()
    assert building.wait(timeout=5)
    small.keyword_index  # noqa: B018 - the build under test
    small_built.set()
    builder.join(timeout=10)
    assert waited == [True]
    assert small.keyword_top_k("jar", 5) and big.keyword_top_k("shelf", 5)
    assert big.keyword_index is big.keyword_index  # built once


def test_words_are_the_pinned_snowball_english_stems() -> None:
    """Replicas rank alike only if they stem alike: the stems of the Snowball release PyStemmer 3.1 bundles."""
    from memory_service.keywords import words

    assert words(["Hiking skis, the International jars"]) == [["hike", "ski", "internat", "jar"]]
