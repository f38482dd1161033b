"""The fleet benchmark's own logic: each node's cache share, the Prometheus sums it reads, its report."""

from __future__ import annotations

from benchmarks.fleet import FLEET_CACHE_SHARE, fleet_node_cache_mb, report
from benchmarks.serve import cold_node_cache_mb
from benchmarks.serve_requests import synthetic_workload
from harness.router import metric_total


def test_each_nodes_cache_holds_its_share_of_the_users_kv_with_a_margin(tiny_llama_dir) -> None:
    workload = synthetic_workload(8, 40, clauses=1)
    every_user_mb = cold_node_cache_mb(tiny_llama_dir, "float32", workload, 8) / 1.5
    for nodes in (2, 4):
        cache_mb = fleet_node_cache_mb(tiny_llama_dir, "float32", workload, nodes)
        share_mb = FLEET_CACHE_SHARE / nodes * every_user_mb
        assert share_mb - 1 <= cache_mb <= share_mb + 2
        assert cache_mb < every_user_mb  # no node holds every user


def test_metric_totals_sum_label_sets_or_those_with_the_given_labels() -> None:
    samples = {'inferscale_node_memory_requests_total{mode="kv"}': 3.0,
               'inferscale_node_memory_requests_total{mode="off"}': 2.0,
               "inferscale_node_memory_requests_created": 9.0,
               'vllm_router_processed_requests_total{worker="http://127.0.0.1:1"}': 4.0}
    assert metric_total(samples, "inferscale_node_memory_requests_total") == 5.0
    assert metric_total(samples, "inferscale_node_memory_requests_total", 'mode="kv"') == 3.0
    assert metric_total(samples, "vllm_router_processed_requests_total", 'worker="http://127.0.0.1:1"') == 4.0
    assert metric_total(samples, "vllm_router_processed_requests_total", 'worker="http://127.0.0.1:2"') == 0.0


def test_report_prints_each_routings_hit_rate_latency_and_requests_per_node(capsys) -> None:
    def row(hit: float, per_node: list[float]) -> dict:
        return {"requests": sum(per_node), "node_cache_hit_rate": hit, "requests_per_node": per_node,
                "query_to_first_token_ms": {"p50": 61.0, "p99": 90.0}, "facts_fetched_per_request": 0.5,
                "busiest_over_mean": max(per_node) / (sum(per_node) / len(per_node))}

    results = {"label": "two nodes", "routings": {"consistent-hash": {"c1": {"20": row(0.99, [70.0, 58.0])}},
                                                  "round-robin": {"c1": {"20": row(0.41, [64.0, 64.0])}}}}
    report(results, ["c1"], [20])
    out = capsys.readouterr().out
    assert "consistent-hash" in out and "0.990" in out and "70 / 58" in out and "1.09" in out
    assert "round-robin" in out and "0.410" in out and "64 / 64" in out and "1.00" in out
