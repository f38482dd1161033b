"""The in-memory search cache: exact top-k, LRU budget, and no stale entry installed across a write."""

from __future__ import annotations

import gc

import numpy as np

from memory_service.models import StoredFact
from memory_service.user_facts import UserFacts
from memory_service.user_writes import UserFactsCache


def _facts(user: str, vectors: list[list[float]], metadata_json: str = "{}") -> UserFacts:
    rows = [(user, f"f{i}", "x" * 10, "", 0, metadata_json, 1, 0, 0, f"h{i}") for i in range(len(vectors))]
    matrix = np.asarray(vectors, dtype=np.float32)
    return UserFacts(rows, matrix / np.linalg.norm(matrix, axis=1, keepdims=True))


def test_top_k_is_best_first_by_cosine_with_ties_broken_by_fact_id() -> None:
    entry = _facts("u", [[0, 1], [1, 0], [1, 1], [1, 0]])
    ranked = entry.top_k(np.asarray([1.0, 0.0]), 3)
    assert [r.fact.fact_id for r in ranked] == ["f1", "f3", "f2"]
    assert ranked[2].score == np.float32(np.sqrt(0.5))
    assert [r.fact.fact_id for r in entry.top_k(np.asarray([0.0, 1.0]), 10)] == ["f0", "f2", "f1", "f3"]


def test_a_result_is_the_stored_fact_of_its_row_with_metadata_parsed() -> None:
    entry = _facts("u", [[1, 0]], metadata_json='{"lang": "en", "note": "caf\u00e9"}')
    assert entry.top_k(np.asarray([1.0, 0.0]), 1)[0].fact == StoredFact(
        user_id="u", fact_id="f0", text="x" * 10, source_turn_id="", timestamp_us=0,
        metadata={"lang": "en", "note": "café"}, version=1, created_at_us=0, updated_at_us=0)


def test_cached_rows_leave_the_garbage_collectors_view() -> None:
    entry = _facts("u", [[1, 0]] * 1000)
    gc.collect()
    assert not any(gc.is_tracked(row) for row in entry.rows)


def test_an_entry_read_before_a_write_is_not_installed() -> None:
    cache = UserFactsCache(1 << 20)
    generation = cache.generation("u")
    cache.invalidate("u")  # a write committed while the reader was reading LanceDB
    assert not cache.put("u", _facts("u", [[1, 0]]), generation)
    assert cache.get("u") is None
    assert cache.put("u", _facts("u", [[1, 0]]), cache.generation("u"))
    cache.invalidate("u")
    assert cache.get("u") is None


def test_least_recently_used_users_leave_first_when_over_budget() -> None:
    one = _facts("a", [[1, 0]] * 8)
    cache = UserFactsCache(2 * one.nbytes)
    for user in ("a", "b"):
        cache.put(user, _facts(user, [[1, 0]] * 8), cache.generation(user))
    cache.get("a")
    cache.put("c", _facts("c", [[1, 0]] * 8), cache.generation("c"))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.bytes_used <= cache.budget_bytes


def test_a_user_larger_than_the_budget_is_searched_elsewhere_until_written_to() -> None:
    big = _facts("big", [[1, 0]] * 64)
    cache = UserFactsCache(big.nbytes - 1)
    assert not cache.put("big", big, cache.generation("big"))
    assert not cache.may_hold("big") and cache.may_hold("other")
    cache.invalidate("big")
    assert cache.may_hold("big")


def test_an_upsert_replaces_and_appends_rows_of_a_cached_user_and_drops_reads_in_flight() -> None:
    cache = UserFactsCache(1 << 20)
    cache.put("u", _facts("u", [[1, 0], [0, 1]]), cache.generation("u"))
    generation = cache.generation("u")
    written = _facts("u", [[0, 1], [1, 1], [1, 0]])  # f0 changed; f1 unchanged ids rewritten; f2 new
    cache.upsert("u", written.rows, written.vectors)
    entry = cache.get("u")
    assert entry is not None and [row[1] for row in entry.rows] == ["f0", "f1", "f2"]
    assert np.array_equal(entry.vectors, written.vectors)
    assert [r.fact.fact_id for r in entry.top_k(np.asarray([0.0, 1.0]), 1)] == ["f0"]
    assert not cache.put("u", _facts("u", [[1, 0]]), generation)  # a read taken before the write is stale


def test_an_upsert_to_a_user_not_cached_installs_nothing() -> None:
    cache = UserFactsCache(1 << 20)
    written = _facts("u", [[1, 0]])
    cache.upsert("u", written.rows, written.vectors)
    assert cache.get("u") is None and cache.bytes_used == 0
