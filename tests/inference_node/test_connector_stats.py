"""The connector's stats: summed across workers and steps, empty when nothing happened."""

from __future__ import annotations

from inference_node.connector.stats import COUNTERS, LoadStats


def test_stats_from_two_workers_add_up_and_reduce_to_every_counter() -> None:
    first, second = LoadStats(), LoadStats()
    first.add("loads", 2)
    first.add("load_failures")
    second.add("loads", 3)
    second.add("node_cache_lookups", 4)
    total = first.aggregate(LoadStats(data=second.to_dict()))
    assert total.reduce() == {**dict.fromkeys(COUNTERS, 0), "loads": 5, "load_failures": 1, "node_cache_lookups": 4}


def test_new_or_reset_stats_are_empty() -> None:
    stats = LoadStats()
    assert stats.is_empty()
    stats.add("loads")
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty()
