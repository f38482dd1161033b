"""Writes InferScale's Grafana dashboards (dashboards/*.json) and the operator's PrometheusRule (prometheusrule.yaml,
from alerts.rules.yaml) next to this file: `python deploy/monitoring/generate.py`; `--check` writes nothing and
fails when a written file differs from what it would write.

The panels below are the source of the dashboards, and alerts.rules.yaml the source of the alerts. Queries name
only series InferScale and vLLM export (tests/deploy/test_monitoring.py evaluates each one against real processes)
and tell targets apart by the job label the scrape configurations here set: `memory-service`, `inference-node`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
RULES_SOURCE = HERE / "alerts.rules.yaml"
PROMETHEUS_RULE = HERE / "prometheusrule.yaml"
DASHBOARDS_DIR = HERE / "dashboards"

# The dashboard schema Grafana 10.4 and 11 write.
SCHEMA_VERSION = 39
GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"  # Grafana's rate window: at least four scrape intervals
RANGE = "$__range"  # the dashboard's time range, for counts in stat panels
DEADLINE_S = 2.0  # the node's default --retrieve-timeout-s

GREEN, ORANGE, RED = "green", "orange", "red"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A time series (`stat=False`) or a single-value stat. `thresholds`: (value, color) steps above a green base
    (a `base` other than green for values where low is bad); drawn as dashed lines on time series when `lines`."""

    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    stat: bool = False
    thresholds: tuple[tuple[float, str], ...] = ()
    base: str = GREEN
    lines: bool = False
    stacked: bool = False
    ratio: bool = False  # a 0..1 share: the axis runs from 0 to 1
    width: int = 12
    height: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = field(default=("inferscale",))


def _quantiles(metric: str, by: str = "", quantiles: tuple[float, ...] = (0.5, 0.99), matchers: str = "",
               label: str = "") -> tuple[Query, ...]:
    """histogram_quantile queries of a classic histogram, one per quantile, grouped `by` (besides le)."""
    group = f"{by}, le" if by else "le"
    legend_by = " ".join(f"{{{{{name.strip()}}}}}" for name in by.split(",") if name.strip())
    return tuple(Query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{matchers}[{RATE}])))",
                       " ".join(part for part in (f"p{round(q * 100)}", label, legend_by) if part))
                 for q in quantiles)


def _ratio(numerator: str, denominator: str, by: str = "") -> str:
    """numerator / denominator of two counters' rates; 0 where the denominator moves and the numerator has no series
    (an error code that never occurred), no value where neither moves."""
    group = f" by ({by}) " if by else ""
    top = f"sum{group}(rate({numerator}[{RATE}]))"
    bottom = f"sum{group}(rate({denominator}[{RATE}]))"
    return f"({top} or {bottom} * 0) / {bottom}"


SERVER_FAULT_CODES = "INTERNAL|UNKNOWN|UNAVAILABLE|DATA_LOSS|DEADLINE_EXCEEDED"
MEMORY_SERVICE_UP = 'up{job="memory-service"}'
NODE_UP = 'up{job="inference-node"}'
RETRIEVE = 'method="RetrieveAndStage"'
KV_PATH_METHODS = 'method=~"RetrieveAndStage|FetchKv"'
MEMORY_REQUESTS = 'inferscale_node_memory_requests_total{mode!="off"}'  # the requests that ask for memory

OVERVIEW = Dashboard(
    uid="inferscale-overview",
    title="InferScale / Overview",
    description="Is memory making requests faster, and is anything wrong.",
    rows=(
        Row("Is anything wrong", (
            Panel("Memory-service replicas up",
                  "Replicas Prometheus scrapes, of those it knows. Nodes retry a refused call on another replica, so "
                  "one down costs capacity; none up means every memory request is served without its memory.",
                  "none", (Query(f"sum({MEMORY_SERVICE_UP})", "up"), Query(f"count({MEMORY_SERVICE_UP})", "known")),
                  stat=True, base=RED, thresholds=((1, GREEN),), width=4, height=4),
            Panel("Inference nodes up", "Nodes Prometheus scrapes, of those it knows.", "none",
                  (Query(f"sum({NODE_UP})", "up"), Query(f"count({NODE_UP})", "known")),
                  stat=True, base=RED, thresholds=((1, GREEN),), width=4, height=4),
            Panel("Requests without their memory",
                  "Memory requests in the time range answered without their memory, by reason: deadline "
                  "(RetrieveAndStage past the node's --retrieve-timeout-s), unavailable (no memory-service replica "
                  "answered), error (any other status).", "short",
                  (Query(f"sum by (reason) (increase(inferscale_node_memory_dropped_total[{RANGE}]))", "{{reason}}"),),
                  stat=True, thresholds=((1, RED),), width=4, height=4),
            Panel("Fact-KV load failures",
                  "Loads into vLLM's paged cache that failed in the time range; vLLM recomputed those tokens (a "
                  "right answer without the speed-up).", "short",
                  (Query(f"sum(increase(inferscale_connector_load_failures_total[{RANGE}]))"),),
                  stat=True, thresholds=((1, ORANGE),), width=4, height=4),
            Panel("Refused load plans",
                  "Plans the connector refused (unsigned, altered, stale: a security signal) and plans or reserved "
                  "cache salts clients sent, which the middleware stripped, in the time range.", "short",
                  (Query(f"sum(increase(inferscale_connector_plans_refused_total[{RANGE}]))", "refused"),
                   Query(f"sum(increase(inferscale_node_client_plans_refused_total[{RANGE}]))", "sent by clients")),
                  stat=True, thresholds=((1, RED),), width=4, height=4),
            Panel("Oldest fact waiting for its KV",
                  "Age of the oldest fact queued for KV, over every profile. Until its KV is ready a fact is "
                  "prefilled as text.", "s", (Query("max(inferscale_kv_queue_lag_seconds)"),),
                  stat=True, thresholds=((60, ORANGE), (300, RED)), width=4, height=4),
        )),
        Row("Is memory making requests faster", (
            Panel("Memory requests by mode",
                  "kv injects the facts' KV, text prefills them, off adds no memory.", "reqps",
                  (Query(f"sum by (mode) (rate(inferscale_node_memory_requests_total[{RATE}]))", "{{mode}}"),),
                  stacked=True),
            Panel("Prompt tokens not prefilled",
                  "Share of all prompt tokens written from fact KV instead of prefilled (the speed-up's source), "
                  "next to vLLM's own prefix cache.", "percentunit",
                  (Query(f"sum(rate(inferscale_connector_tokens_loaded_total[{RATE}])) / "
                         f"sum(rate(vllm:prompt_tokens_total[{RATE}]))", "injected from fact KV"),
                   Query(f"sum(rate(vllm:prefix_cache_hits_total[{RATE}])) / "
                         f"sum(rate(vllm:prefix_cache_queries_total[{RATE}]))", "vLLM prefix cache")),
                  ratio=True),
            Panel("Query to first token, p50: memory step + vLLM",
                  "The memory step (RetrieveAndStage, in the node's middleware) runs before vLLM receives the "
                  "request; vLLM's time to first token starts after it. Stacked medians: what a request waits.", "s",
                  (*_quantiles("inferscale_node_stage_seconds", quantiles=(0.5,), label="memory step"),
                   *_quantiles("vllm:time_to_first_token_seconds", quantiles=(0.5,), label="vLLM TTFT")),
                  stacked=True),
            Panel("Facts placed in prompts",
                  "Facts injected as KV, and facts prefilled as text (text mode, KV not ready yet, recomputed tail "
                  "facts, or memory shorter than the KV crossover), per second.", "short",
                  (Query(f"sum by (how) (rate(inferscale_node_facts_total[{RATE}]))", "as {{how}}"),),
                  stacked=True),
            Panel("KV on hand",
                  "Retrieved facts whose KV was ready at the memory service, and chunk lookups the node's "
                  "device cache served without fetching.", "percentunit",
                  (Query(_ratio("inferscale_kv_ready_total", "inferscale_kv_lookups_total"),
                         "retrieved facts with KV ready"),
                   Query(_ratio("inferscale_connector_node_cache_hits_total",
                                "inferscale_connector_node_cache_lookups_total"), "node-cache hits")),
                  ratio=True),
            Panel("RetrieveAndStage p99 at the nodes",
                  "As the nodes see it. Past the node's --retrieve-timeout-s (2 s by default, the red line) a "
                  "request is served without its memory.", "s",
                  _quantiles("inferscale_node_stage_seconds", quantiles=(0.99,)),
                  thresholds=((DEADLINE_S / 2, ORANGE), (DEADLINE_S, RED)), lines=True),
        )),
    ),
)

MEMORY_SERVICE = Dashboard(
    uid="inferscale-memory-service",
    title="InferScale / Memory service",
    description="RPCs, retrieval and embedding, stored memory, the fact-KV pipeline and its workers, fact KV read "
                "for the nodes, KV tiers.",
    rows=(
        Row("Replicas and RPCs", (
            Panel("Replicas up", "Memory-service replicas Prometheus scrapes.", "none",
                  (Query(f"sum({MEMORY_SERVICE_UP})"),), stat=True, base=RED, thresholds=((1, GREEN),),
                  width=6, height=4),
            Panel("Server-fault ratio",
                  f"Calls ending {SERVER_FAULT_CODES.replace('|', ', ')}, of all calls, over every method.",
                  "percentunit",
                  (Query(_ratio(f'inferscale_rpc_requests_total{{code=~"{SERVER_FAULT_CODES}"}}',
                                "inferscale_rpc_requests_total")),),
                  stat=True, thresholds=((0.001, ORANGE), (0.01, RED)), width=6, height=4),
            Panel("Facts stored", "Facts stored, all users.", "short", (Query("max(inferscale_facts_stored)"),),
                  stat=True, width=6, height=4),
            Panel("Turns stored", "Conversation turns stored, all users.", "short",
                  (Query("max(inferscale_turns_stored)"),), stat=True, width=6, height=4),
            Panel("Calls by method", "gRPC calls per second, every replica.", "reqps",
                  (Query(f"sum by (method) (rate(inferscale_rpc_requests_total[{RATE}]))", "{{method}}"),)),
            Panel("Calls not OK by method and code",
                  "A caller's mistakes (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, PERMISSION_DENIED), server "
                  "faults (INTERNAL, UNAVAILABLE) and calls their caller gave up on (CANCELLED: for RetrieveAndStage, "
                  "a node's deadline passed).", "reqps",
                  (Query(f'sum by (method, code) (rate(inferscale_rpc_requests_total{{code!="OK"}}[{RATE}]))',
                         "{{method}} {{code}}"),)),
            Panel("Latency p50 by method", "Time from a call's arrival to its answer.", "s",
                  _quantiles("inferscale_rpc_duration_seconds", "method", (0.5,))),
            Panel("Latency p99 by method",
                  "The red line is the nodes' default RetrieveAndStage deadline (2 s).", "s",
                  _quantiles("inferscale_rpc_duration_seconds", "method", (0.99,)),
                  thresholds=((DEADLINE_S, RED),), lines=True),
            Panel("Not-OK ratio by method", "Calls that did not end OK, of each method's calls.", "percentunit",
                  (Query(_ratio('inferscale_rpc_requests_total{code!="OK"}', "inferscale_rpc_requests_total",
                                "method"), "{{method}}"),), ratio=True),
            Panel("RetrieveAndStage outcomes", "RetrieveAndStage calls per second by status code.", "reqps",
                  (Query(f"sum by (code) (rate(inferscale_rpc_requests_total{{{RETRIEVE}}}[{RATE}]))", "{{code}}"),),
                  stacked=True),
            Panel("Batched RetrieveAndStage calls by outcome",
                  "Calls answered inside RetrieveAndStageBatch per second, by each call's own status code "
                  "(PERMISSION_DENIED: a node credential asked for a user outside its users).", "reqps",
                  (Query(f"sum by (code) (rate(inferscale_batched_calls_total[{RATE}]))", "{{code}}"),),
                  stacked=True),
        )),
        Row("Retrieval and embedding", (
            Panel("Embedding latency",
                  "Embedding an ingest batch, or one query (its wait for a batch included).", "s",
                  _quantiles("inferscale_embedding_duration_seconds", "purpose")),
            Panel("Vector search latency", "Exact search of a user's facts, embedding excluded.", "s",
                  _quantiles("inferscale_retrieval_duration_seconds")),
            Panel("Searches and facts returned",
                  "Searches per second, facts returned by SearchFacts and RetrieveAndStage, and queries whose "
                  "vector the caller embedded (nodes with --embed-queries-locally).", "short",
                  (Query(f"sum(rate(inferscale_retrieval_duration_seconds_count[{RATE}]))", "searches"),
                   Query(f"sum(rate(inferscale_facts_retrieved_total[{RATE}]))", "facts returned"),
                   Query(f"sum(rate(inferscale_caller_embedded_queries_total[{RATE}]))", "embedded by the caller"))),
            Panel("Batch sizes",
                  "Mean queries embedded together in one model call, and mean facts per IngestFacts call.", "short",
                  (Query(f"sum(rate(inferscale_query_embedding_batch_queries_sum[{RATE}])) / "
                         f"sum(rate(inferscale_query_embedding_batch_queries_count[{RATE}]))",
                         "queries per model call"),
                   Query(f"sum(rate(inferscale_ingest_batch_facts_sum[{RATE}])) / "
                         f"sum(rate(inferscale_ingest_batch_facts_count[{RATE}]))", "facts per IngestFacts"))),
        )),
        Row("Stored memory", (
            Panel("Facts and turns stored", "Every user's facts and conversation turns.", "short",
                  (Query("max(inferscale_facts_stored)", "facts"), Query("max(inferscale_turns_stored)", "turns"))),
            Panel("Facts ingested by outcome", "Facts received by IngestFacts per second: created, updated, "
                  "unchanged.", "short",
                  (Query(f"sum by (outcome) (rate(inferscale_facts_ingested_total[{RATE}]))", "{{outcome}}"),),
                  stacked=True),
        )),
        Row("Fact-KV pipeline and precompute workers", (
            Panel("Facts waiting for KV", "Queued and leased facts per KV profile (every replica reports the "
                  "shared queue).", "short",
                  (Query('max by (profile_id, state) (inferscale_kv_queue_facts{state=~"queued|leased"})',
                         "{{state}} {{profile_id}}"),)),
            Panel("Oldest fact waiting (KV lag)",
                  "Age of the oldest fact queued per profile. Still growing past 5 minutes (the red line): the "
                  "profile's workers are gone or slower than ingest (alert InferScaleKvLagGrowing).", "s",
                  (Query("max by (profile_id) (inferscale_kv_queue_lag_seconds)", "{{profile_id}}"),),
                  thresholds=((300, RED),), lines=True),
            Panel("Facts with KV, and failed", "Facts whose KV is stored, and facts a worker could not encode, "
                  "per profile.", "short",
                  (Query('max by (profile_id, state) (inferscale_kv_queue_facts{state=~"done|failed"})',
                         "{{state}} {{profile_id}}"),)),
            Panel("KV work", "Facts leased to workers, uploads by outcome, and facts workers reported they could "
                  "not encode, per second.", "short",
                  (Query(f"sum(rate(inferscale_kv_facts_leased_total[{RATE}]))", "leased"),
                   Query(f"sum by (outcome) (rate(inferscale_kv_uploads_total[{RATE}]))", "uploaded {{outcome}}"),
                   Query(f"sum(rate(inferscale_kv_work_failures_total[{RATE}]))", "failed"))),
            Panel("Worker capacity",
                  "Facts each worker encodes per second of encoding, as it last reported (workers that leased in "
                  "the last 10 minutes). Compare their sum with the ingest rate.", "short",
                  (Query("max by (worker_id) (inferscale_worker_facts_per_second)", "{{worker_id}}"),
                   Query("sum(max by (worker_id) (inferscale_worker_facts_per_second))", "all workers"))),
            Panel("Worker device memory in use", "Each GPU worker's device memory in use, of its total, as it last "
                  "reported (workers without a GPU report none).", "percentunit",
                  (Query("max by (worker_id) (inferscale_worker_device_memory_used_bytes) / "
                         "max by (worker_id) (inferscale_worker_device_memory_total_bytes)", "{{worker_id}}"),),
                  ratio=True, thresholds=((0.95, RED),), lines=True),
            Panel("Worker device utilization", "Each GPU worker's device utilization, as it last reported.",
                  "percent",
                  (Query("max by (worker_id) (inferscale_worker_device_utilization_percent)", "{{worker_id}}"),)),
            Panel("KV audits",
                  "Stored KV another worker computed again, by outcome, and memory headers that differed from the "
                  "stored one, per second; the audits waiting for a worker; the profiles whose header waits for a "
                  "second worker credential to agree (their memory is served as text meanwhile: alert "
                  "InferScaleHeaderAwaitingWitness). A mismatch or a header conflict means a worker produced KV "
                  "another computed differently: its entry is served as text until recomputed (alert "
                  "InferScaleKvAuditMismatch).", "short",
                  (Query(f"sum by (outcome) (rate(inferscale_kv_audits_total[{RATE}]))", "audited {{outcome}}"),
                   Query(f"sum(rate(inferscale_kv_header_conflicts_total[{RATE}]))", "header conflicts"),
                   Query("max(inferscale_kv_audits_waiting)", "waiting"),
                   Query("max(inferscale_kv_profiles_awaiting_header)", "profiles awaiting a header"))),
        )),
        Row("Fact KV read for the nodes", (
            Panel("KV bytes read by tier",
                  "Fact-KV bytes read per second to answer FetchKv (the nodes' node-cache misses): from the host "
                  "cache (host), or on a miss from the durable tier (disk or object-store); concurrent misses of one "
                  "blob share one read.", "Bps",
                  (Query(f"sum by (tier) (rate(inferscale_kv_bytes_read_total[{RATE}]))", "{{tier}}"),),
                  stacked=True, width=8),
            Panel("KV bytes served",
                  "Fact-KV bytes handed to FetchKv per second. Above the bytes read when concurrent misses of a "
                  "blob shared one read.", "Bps",
                  (Query(f"sum(rate(inferscale_kv_bytes_served_total[{RATE}]))", "served"),), width=8),
            Panel("RetrieveAndStage and FetchKv calls",
                  "Calls per second. RetrieveAndStage (on every memory request's path) reads no KV: the bytes read "
                  "follow FetchKv.", "reqps",
                  (Query(f'sum by (method) (rate(inferscale_rpc_requests_total{{{KV_PATH_METHODS}}}[{RATE}]))',
                         "{{method}}"),), width=8),
        )),
        Row("KV tiers", (
            Panel("KV bytes held by tier",
                  "Bytes of fact KV in each replica's tiers, and each tier's budget (dashed).", "bytes",
                  (Query("sum by (instance, tier) (inferscale_kv_tier_bytes)", "{{tier}} {{instance}}"),
                   Query("sum by (instance, tier) (inferscale_kv_tier_budget_bytes)",
                         "{{tier}} budget {{instance}}"))),
            Panel("KV tier hit ratio", "Lookups found in each tier, of the lookups that reached it.", "percentunit",
                  (Query(_ratio("inferscale_kv_tier_hits_total", "inferscale_kv_tier_lookups_total", "tier"),
                         "{{tier}}"),), ratio=True),
            Panel("Retrieved facts with KV ready",
                  "Share of the facts RetrieveAndStage returned whose KV was stored: the rest are prefilled as text.",
                  "percentunit",
                  (Query(_ratio("inferscale_kv_ready_total", "inferscale_kv_lookups_total"), "KV ready"),),
                  ratio=True),
            Panel("KV blobs held and evicted", "Blobs held by tier, and evictions per second.", "short",
                  (Query("sum by (tier) (inferscale_kv_tier_entries)", "held {{tier}}"),
                   Query(f"sum by (tier) (rate(inferscale_kv_tier_evictions_total[{RATE}]))", "evicted/s {{tier}}"))),
            Panel("Shared-state traffic",
                  "Requests to the object store for fact KV and SQL statements to the coordination store "
                  "(PostgreSQL or SQLite), per second.", "short",
                  (Query(f"sum(rate(inferscale_object_store_requests_total[{RATE}]))", "object store"),
                   Query(f"sum(rate(inferscale_coordination_statements_total[{RATE}]))", "coordination SQL"))),
            Panel("Corrupt KV blobs", "Disk or object-store blobs that failed their checksum in the time range "
                  "(they are refused, never served).", "short",
                  (Query(f"sum(increase(inferscale_kv_corrupt_blobs_total[{RANGE}]))"),),
                  stat=True, thresholds=((1, RED),), width=6, height=8),
        )),
    ),
)

INFERENCE_NODE = Dashboard(
    uid="inferscale-inference-node",
    title="InferScale / Inference nodes",
    description="Memory requests, fact-KV loads, RetrieveAndStage as the nodes see it, and vLLM's own latency.",
    rows=(
        Row("Memory requests", (
            Panel("Memory requests by mode", "Requests with a memory field per second.", "reqps",
                  (Query(f"sum by (mode) (rate(inferscale_node_memory_requests_total[{RATE}]))", "{{mode}}"),),
                  stacked=True),
            Panel("Facts placed in prompts", "Facts injected as KV and prefilled as text, per second.", "short",
                  (Query(f"sum by (how) (rate(inferscale_node_facts_total[{RATE}]))", "as {{how}}"),), stacked=True),
            Panel("Injected and prompt tokens", "Prompt tokens written from fact KV, and all prompt tokens, per "
                  "second and node.", "short",
                  (Query(f"sum by (instance) (rate(inferscale_connector_tokens_loaded_total[{RATE}]))",
                         "injected {{instance}}"),
                   Query(f"sum by (instance) (rate(vllm:prompt_tokens_total[{RATE}]))", "prompt {{instance}}"))),
            Panel("Share of prompt tokens injected", "Prompt tokens written from fact KV, of all prompt tokens.",
                  "percentunit",
                  (Query(f"sum by (instance) (rate(inferscale_connector_tokens_loaded_total[{RATE}])) / "
                         f"sum by (instance) (rate(vllm:prompt_tokens_total[{RATE}]))", "{{instance}}"),),
                  ratio=True),
        )),
        Row("Fact-KV loads", (
            Panel("Loads: synchronous and async",
                  "Synchronous loads (every chunk in the node cache, written before the step) and async loads "
                  "(misses fetched from the memory service while the request waits), per second.", "short",
                  (Query(f"sum by (instance) (rate(inferscale_connector_loads_total[{RATE}])) - "
                         f"sum by (instance) (rate(inferscale_connector_async_loads_total[{RATE}]))",
                         "synchronous {{instance}}"),
                   Query(f"sum by (instance) (rate(inferscale_connector_async_loads_total[{RATE}]))",
                         "async {{instance}}"))),
            Panel("Node-cache hit ratio", "Chunk lookups the node's device-resident fact-KV cache served.",
                  "percentunit",
                  (Query(_ratio("inferscale_connector_node_cache_hits_total",
                                "inferscale_connector_node_cache_lookups_total", "instance"), "{{instance}}"),),
                  ratio=True),
            Panel("Fetched chunks and synchronous misses",
                  "Chunks fetched from the memory service (node-cache misses), and synchronous loads refused "
                  "because a chunk left the cache in between (recomputed), per second.", "short",
                  (Query(f"sum by (instance) (rate(inferscale_connector_facts_fetched_total[{RATE}]))",
                         "fetched {{instance}}"),
                   Query(f"sum by (instance) (rate(inferscale_connector_sync_misses_total[{RATE}]))",
                         "synchronous misses {{instance}}"))),
            Panel("Node-cache tiers: where missing chunks came from",
                  "Chunks brought into the device tier per second: copied from the node's host tier, or fetched "
                  "from the memory service; and chunks ordered into the host tier in the background (a user's "
                  "warm-up, what a partial load left out).", "short",
                  (Query(f"sum by (instance) (rate(inferscale_connector_host_tier_hits_total[{RATE}]))",
                         "host tier {{instance}}"),
                   Query(f"sum by (instance) (rate(inferscale_connector_facts_fetched_total[{RATE}]))",
                         "memory service {{instance}}"),
                   Query(f"sum by (instance) (rate(inferscale_connector_warmed_chunks_total[{RATE}]))",
                         "warmed {{instance}}"))),
            Panel("Fetched from the durable tier",
                  "Of the chunks fetched, the share the nodes read from the memory service's durable tier "
                  "themselves (--kv-durable-tier) rather than over FetchKv. 0 where the flag is not given; below 1, "
                  "chunks the tier lacked, or failed reads (each logged).", "percentunit",
                  (Query(_ratio("inferscale_connector_durable_tier_reads_total",
                                "inferscale_connector_facts_fetched_total", "instance"), "{{instance}}"),),
                  ratio=True),
            Panel("Node-cache tiers: bandwidth",
                  "Bytes per second of transfer time, per tier a miss read from (host-to-device copies; fetches "
                  "from the memory service, checks and decode included): what the miss policy weighs.", "Bps",
                  (Query(_ratio("inferscale_connector_host_bytes_copied_total",
                                "inferscale_connector_host_copy_micros_total", "instance") + " * 1e6",
                         "host tier {{instance}}"),
                   Query(_ratio("inferscale_connector_source_bytes_fetched_total",
                                "inferscale_connector_source_fetch_micros_total", "instance") + " * 1e6",
                         "memory service {{instance}}"))),
            Panel("Miss policy: waited and partial",
                  "Per second: loads whose request waited for its missing chunks (the policy judged them faster "
                  "to bring than to prefill), and requests served at once with their resident prefix, the rest "
                  "prefilled while it was fetched.", "short",
                  (Query(f"sum by (instance) (rate(inferscale_connector_async_loads_total[{RATE}]))",
                         "waited {{instance}}"),
                   Query(f"sum by (instance) (rate(inferscale_connector_partial_loads_total[{RATE}]))",
                         "partial {{instance}}"))),
            Panel("Load failures and refused plans",
                  "Failed loads (recomputed by vLLM), plans the connector refused (forged or stale: a security "
                  "signal), and plans or reserved salts clients sent (stripped), per rate window. Healthy: 0.",
                  "short",
                  (Query(f"sum by (instance) (increase(inferscale_connector_load_failures_total[{RATE}]))",
                         "load failures {{instance}}"),
                   Query(f"sum by (instance) (increase(inferscale_connector_plans_refused_total[{RATE}]))",
                         "refused plans {{instance}}"),
                   Query(f"sum by (instance) (increase(inferscale_node_client_plans_refused_total[{RATE}]))",
                         "client plans stripped {{instance}}")),
                  thresholds=((1, RED),), lines=True),
            Panel("Fetch processes started",
                  "Fetch processes the node's ranks started, per rate window: one per rank as the node starts, one "
                  "more after each that exited (the fetches it had in flight failed and their requests prefilled). "
                  "Healthy after the start: 0.", "short",
                  (Query(f"sum by (instance) (increase(inferscale_connector_fetch_processes_started_total[{RATE}]))",
                         "{{instance}}"),),
                  lines=True),
        )),
        Row("RetrieveAndStage", (
            Panel("RetrieveAndStage calls per RPC",
                  "Mean calls each RPC to the memory service carried: 1 while fewer than 4 were under way; more when "
                  "the node batched the calls that arrived meanwhile (RetrieveAndStageBatch).", "short",
                  (Query(f"sum by (instance) (rate(inferscale_node_retrieve_batch_calls_sum[{RATE}])) / "
                         f"sum by (instance) (rate(inferscale_node_retrieve_batch_calls_count[{RATE}]))",
                         "{{instance}}"),)),
            Panel("RetrieveAndStage latency",
                  "As each node sees it, successful calls only. Orange: half the default deadline; red: the "
                  "default --retrieve-timeout-s (2 s), past which the request is served without its memory.", "s",
                  _quantiles("inferscale_node_stage_seconds", "instance", (0.5, 0.99)),
                  thresholds=((DEADLINE_S / 2, ORANGE), (DEADLINE_S, RED)), lines=True),
            Panel("Memory requests served without their memory",
                  "Share of each node's kv and text requests answered without their memory, by reason: deadline "
                  "(RetrieveAndStage past --retrieve-timeout-s), unavailable (no memory-service replica answered), "
                  "error (any other status; the x-inferscale-memory header names the code). Orange: 1% (alert "
                  "InferScaleNodeMemoryDropped); red: 5% (InferScaleNodeMemoryServiceUnreachable).", "percentunit",
                  (Query(f"sum by (instance, reason) (rate(inferscale_node_memory_dropped_total[{RATE}])) "
                         f"/ on (instance) group_left "
                         f"sum by (instance) (rate({MEMORY_REQUESTS}[{RATE}]))", "{{reason}} {{instance}}"),),
                  ratio=True, thresholds=((0.01, ORANGE), (0.05, RED)), lines=True),
        )),
        Row("Router", (
            Panel("Requests per node, by routing",
                  "Requests the routers sent to each node, per second, by policy: consistent_hash (requests naming "
                  "a user: a user's requests go to one node, so an uneven split is the users' own) and power_of_two "
                  "(requests naming none, to the less busy node).", "reqps",
                  (Query(f'sum by (policy, worker) (rate(vllm_router_policy_decisions_total{{job="inference-router"}}'
                         f'[{RATE}]))', "{{policy}} {{worker}}"),)),
            Panel("Nodes the router admits",
                  "Per node: healthy by the router's health checks (1) and its circuit breaker closed (0; 1: open, "
                  "2: half open). A node out of the ring has its users hashed onto the others.", "short",
                  (Query('min by (worker) (vllm_router_worker_health{job="inference-router"})', "healthy {{worker}}"),
                   Query('max by (worker) (vllm_router_cb_state{job="inference-router"})', "breaker {{worker}}"))),
        )),
        Row("vLLM", (
            Panel("Time to first token", "vLLM's, from the request's arrival in vLLM (after the memory step).", "s",
                  _quantiles("vllm:time_to_first_token_seconds")),
            Panel("Queue time", "Time requests wait before vLLM schedules them (an async fact-KV load waits here "
                  "too).", "s", _quantiles("vllm:request_queue_time_seconds")),
            Panel("Prefill time", "Time in prefill per request: injected tokens are not prefilled.", "s",
                  _quantiles("vllm:request_prefill_time_seconds")),
            Panel("End-to-end request latency", "vLLM's, arrival to last token.", "s",
                  _quantiles("vllm:e2e_request_latency_seconds")),
            Panel("Requests running and waiting", "Requests in the batch and waiting, per node.", "short",
                  (Query("sum by (instance) (vllm:num_requests_running)", "running {{instance}}"),
                   Query("sum by (instance) (vllm:num_requests_waiting)", "waiting {{instance}}"))),
            Panel("Paged KV cache usage", "Share of vLLM's paged KV cache in use, per node.", "percentunit",
                  (Query("max by (instance) (vllm:kv_cache_usage_perc)", "{{instance}}"),), ratio=True),
            Panel("vLLM prefix-cache hit ratio", "Prompt tokens vLLM's own prefix cache served (text-mode memory of "
                  "the same user reuses it).", "percentunit",
                  (Query(_ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "instance"),
                         "{{instance}}"),), ratio=True),
        )),
    ),
)

DASHBOARDS = (OVERVIEW, MEMORY_SERVICE, INFERENCE_NODE)


def _thresholds(panel: Panel) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": panel.base, "value": None}]
    steps += [{"color": color, "value": value} for value, color in panel.thresholds]
    return {"mode": "absolute", "steps": steps}


def _several_values(panel: Panel) -> bool:
    """Whether the panel shows several series: several queries, or one split by a label its legend names."""
    return len(panel.queries) > 1 or "{{" in panel.queries[0].legend


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, "thresholds": _thresholds(panel),
                                "color": {"mode": "palette-classic"}}
    if panel.ratio:
        defaults.update(min=0, max=1)
    if panel.stat:
        defaults["color"] = {"mode": "thresholds"}
        options: dict[str, Any] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background", "graphMode": "none", "justifyMode": "auto", "orientation": "auto",
            "textMode": "value_and_name" if _several_values(panel) else "value"}
    else:
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if panel.stacked else 0, "showPoints": "never",
            "spanNulls": False, "axisSoftMin": 0,
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if panel.lines else "off"}}
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    return {
        "id": panel_id, "type": "stat" if panel.stat else "timeseries", "title": panel.title,
        "description": panel.description, "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
        "targets": [{"refId": chr(ord("A") + index), "datasource": DATASOURCE, "expr": query.expr,
                     "legendFormat": query.legend or "__auto", "range": True, "instant": False}
                    for index, query in enumerate(panel.queries)],
    }


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana imports it: a `datasource` variable every panel and query uses, rows laid out
    left to right on Grafana's 24-column grid, panel ids unique within the dashboard."""
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in dashboard.rows:
        panels.append({"id": next_id, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}})
        next_id, y = next_id + 1, y + 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panels.append(_panel_json(panel, next_id, x, y))
            next_id, x, line_height = next_id + 1, x + panel.width, max(line_height, panel.height)
        y += line_height
    return {
        "uid": dashboard.uid, "title": dashboard.title, "description": dashboard.description,
        "tags": list(dashboard.tags), "editable": True, "graphTooltip": 1, "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION, "version": 1, "timezone": "browser", "fiscalYearStartMonth": 0,
        "time": {"from": "now-3h", "to": "now"}, "timepicker": {}, "liveNow": False,
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [{"title": "InferScale", "type": "dashboards", "tags": ["inferscale"], "asDropdown": True,
                   "includeVars": True, "keepTime": True}],
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
            "regex": "", "skipUrlSync": False}]},
        "panels": panels,
    }


class _BlockStrings(yaml.SafeDumper):
    """Writes multi-line strings (the longer expressions) as YAML block scalars."""


_BlockStrings.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def prometheus_rule_yaml(rules_source: Path = RULES_SOURCE) -> str:
    """The PrometheusRule carrying exactly the rule groups of the plain rules file."""
    groups = yaml.safe_load(rules_source.read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "inferscale", "namespace": "inferscale",
                         "labels": {"app.kubernetes.io/part-of": "inferscale"}},
            "spec": {"groups": groups}}
    header = (f"# Generated by deploy/monitoring/generate.py from {rules_source.name}: edit that file, then rerun "
              "the script.\n")
    return header + yaml.dump(rule, Dumper=_BlockStrings, sort_keys=False, width=120, allow_unicode=True)


def outputs() -> dict[Path, str]:
    """Every file this script writes, by path, with its content."""
    files = {DASHBOARDS_DIR / f"{dashboard.uid}.json": json.dumps(dashboard_json(dashboard), indent=2) + "\n"
             for dashboard in DASHBOARDS}
    files[PROMETHEUS_RULE] = prometheus_rule_yaml()
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; fail if a file is not up to date")
    args = parser.parse_args(argv)
    stale = []
    for path, content in outputs().items():
        if path.exists() and path.read_text() == content:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
    if args.check and stale:
        print("out of date (run python deploy/monitoring/generate.py): "
              + ", ".join(str(path.relative_to(HERE)) for path in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
