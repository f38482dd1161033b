"""The scheduler's node-cache directory (what is resident, what is reserved, what leaves) and the worker's cache."""

from __future__ import annotations

import pytest
import torch

from inference_node.connector.compose import ChunkSlice
from inference_node.connector.node_cache import CachedKv, NodeCacheDirectory, NodeKvCache
from inferscale_kv.kv_key import KvKey


def _key(fact: int) -> KvKey:
    return KvKey("kvp-p", "u", f"f{fact}", 1, f"{fact:032x}")


def _fetched(directory: NodeCacheDirectory, *facts: int, loaded: bool = True, protected=()) -> None:
    directory.start_fetch([(_key(f), 10) for f in facts], set(protected))
    directory.settle([_key(f) for f in facts], loaded)


def test_a_chunk_is_resident_only_once_its_load_finished_without_failure() -> None:
    """Regression: the hint recorded chunks when their load was sent (also in-flight and failed ones)."""
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10)
    directory.start_fetch([(_key(0), 10)], set())
    assert not directory.is_resident(_key(0))  # in flight: a second request for it goes async too
    directory.settle([_key(0)], loaded=False)
    assert not directory.is_resident(_key(0)) and directory.take_evictions() == [_key(0)]
    _fetched(directory, 0)
    assert directory.is_resident(_key(0))


def test_evicts_least_recently_used_unheld_chunks_within_the_budget() -> None:
    directory = NodeCacheDirectory(budget_bytes=300, bytes_per_token=10)  # 3 chunks of 10 tokens
    for fact in range(3):
        _fetched(directory, fact)
    directory.touch([_key(0)])
    _fetched(directory, 3)
    assert directory.take_evictions() == [_key(1)]
    assert [directory.is_resident(_key(f)) for f in range(4)] == [True, False, True, True]
    assert directory.bytes_used <= 300


def test_chunks_of_in_flight_and_same_step_loads_are_never_evicted() -> None:
    directory = NodeCacheDirectory(budget_bytes=200, bytes_per_token=10)
    _fetched(directory, 0)
    _fetched(directory, 1)
    # Over budget by one chunk: 0 is held by this load, 1 is read by a synchronous load of the same step.
    directory.start_fetch([(_key(0), 10), (_key(2), 10)], {_key(1)})
    assert directory.take_evictions() == []
    assert directory.is_resident(_key(0)) and directory.is_resident(_key(1))
    directory.start_fetch([(_key(3), 10)], set())  # the next step: 1 is free to go, 0 still held
    assert directory.take_evictions() == [_key(1)]


def test_a_failed_synchronous_load_stops_trusting_its_chunks() -> None:
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10)
    _fetched(directory, 0)
    directory.drop([_key(0)])
    assert not directory.is_resident(_key(0)) and directory.take_evictions() == [_key(0)]


def _kv(tokens: int) -> CachedKv:
    return CachedKv(torch.zeros(2, tokens, 1, 4), torch.zeros(2, tokens, 1, 4), tuple(range(tokens)))


def test_the_worker_cache_checks_token_ids_on_every_hit() -> None:
    cache = NodeKvCache()
    cache.put(_key(0), _kv(3))
    assert cache.get(_key(0), (0, 1, 2)) is not None
    assert cache.get(_key(0), (0, 1, 9)) is None
    cache.remove([_key(0)])
    assert cache.get(_key(0), (0, 1, 2)) is None and cache.bytes_used == 0


def test_cached_kv_must_hold_one_row_per_token_id() -> None:
    with pytest.raises(ValueError):
        CachedKv(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4), (1, 2))


def test_a_slice_past_its_chunk_is_refused_before_any_kernel_reads_it() -> None:
    """Regression: the fused kernel did not bound its reads; a stale, shorter entry was read out of bounds."""
    entry = _kv(3)
    ChunkSlice(entry.keys, entry.values, 0, 3)
    for begin, end in ((0, 4), (2, 2), (-1, 2)):
        with pytest.raises(ValueError):
            ChunkSlice(entry.keys, entry.values, begin, end)
