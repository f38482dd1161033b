"""Prometheus metrics of the memory service, on their own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from memory_service.kv_pipeline import KvPipeline
    from memory_service.kv_store import TieredKvStore
    from memory_service.sql import Database

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_requests = Counter(
            "inferscale_rpc_requests", "gRPC calls by method and status code", ["method", "code"],
            registry=self.registry,
        )
        self.batched_calls = Counter(
            "inferscale_batched_calls", "RetrieveAndStage calls answered inside RetrieveAndStageBatch, by status code",
            ["code"], registry=self.registry,
        )
        self.batched_calls.labels(code="OK")  # the series exists from the start, at 0 before any batch
        self.rpc_duration = Histogram(
            "inferscale_rpc_duration_seconds", "gRPC call latency by method", ["method"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.facts_stored = Gauge("inferscale_facts_stored", "facts stored, all users", registry=self.registry)
        self.turns_stored = Gauge("inferscale_turns_stored", "turns stored, all users", registry=self.registry)
        self.facts_ingested = Counter(
            "inferscale_facts_ingested", "facts received by IngestFacts, by outcome", ["outcome"],
            registry=self.registry,
        )
        self.ingest_batch_facts = Histogram(
            "inferscale_ingest_batch_facts", "facts per IngestFacts call",
            buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000), registry=self.registry,
        )
        self.embedding_duration = Histogram(
            "inferscale_embedding_duration_seconds",
            "time to embed an ingest batch, or one query (waiting for its batch included)", ["purpose"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.query_batch_queries = Histogram(
            "inferscale_query_embedding_batch_queries", "queries embedded together in one model call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry,
        )
        self.retrieval_duration = Histogram(
            "inferscale_retrieval_duration_seconds", "vector search time per query (excluding embedding)",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.facts_retrieved = Counter(
            "inferscale_facts_retrieved", "facts returned by SearchFacts and RetrieveAndStage",
            registry=self.registry,
        )
        self.caller_embedded_queries = Counter(
            "inferscale_caller_embedded_queries", "searches with a query vector the caller embedded (not embedded "
            "here)", registry=self.registry,
        )

        self.kv_lookups = Counter(
            "inferscale_kv_lookups", "retrieved facts checked for stored KV (RetrieveAndStage)", registry=self.registry
        )
        self.kv_ready = Counter(
            "inferscale_kv_ready", "retrieved facts whose KV was stored (numerator of kv_lookups)",
            registry=self.registry,
        )
        self.kv_facts_leased = Counter(
            "inferscale_kv_facts_leased", "facts handed to precompute workers", registry=self.registry
        )
        self.kv_uploads = Counter(
            "inferscale_kv_uploads", "fact KV uploads by outcome", ["outcome"], registry=self.registry
        )
        self.kv_fetched_blobs = Counter(
            "inferscale_kv_fetched_blobs", "blobs FetchKv was asked for, by outcome (missing: not listed under that "
            "key, or gone when read: the node recomputes those tokens)", ["outcome"], registry=self.registry)
        for outcome in ("served", "missing"):
            self.kv_fetched_blobs.labels(outcome=outcome)
        self.kv_foreign_lease_completions = Counter(
            "inferscale_kv_foreign_lease_completions", "CompleteKvWork calls refused because the lease was not given "
            "to the calling worker identity (another worker's, or never issued): nothing of them is stored",
            registry=self.registry)
        self.kv_work_failures = Counter(
            "inferscale_kv_work_failures", "facts a worker reported it could not encode", registry=self.registry
        )
        self.kv_audits = Counter(
            "inferscale_kv_audits", "stored KV computed again by another worker and compared, by outcome (match, "
            "mismatch: withdrawn and queued for a third worker, stale, abandoned)", ["outcome"],
            registry=self.registry,
        )
        for audit_outcome in ("match", "mismatch", "stale", "abandoned"):  # 0 until the first: alerts see a series
            self.kv_audits.labels(outcome=audit_outcome)
        self.kv_header_conflicts = Counter(
            "inferscale_kv_header_conflicts", "a worker's memory header differing from the stored one or from another "
            "worker's candidate (kept aside; a stored one is withdrawn only while no second worker confirmed it)",
            registry=self.registry,
        )

    def watch_kv(self, kv_store: TieredKvStore, kv_pipeline: KvPipeline) -> None:
        """Exports the KV tiers' accounting, the work queue's state and the workers' reports, read at scrape time."""
        self.registry.register(_KvCollector(kv_store, kv_pipeline))

    def watch_coordination(self, database: Database) -> None:
        """Exports the statements sent to the coordination store (SQLite or PostgreSQL), read at scrape time."""
        self.registry.register(_CountCollector(
            "inferscale_coordination_statements", "SQL statements sent to the coordination store",
            lambda: database.round_trips))

    def serve(self, port: int, host: str) -> None:
        """Exposes /metrics over HTTP on a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)


# Workers that leased within this window are exported.
WORKER_METRICS_WINDOW_S = 600.0


class _CountCollector(Collector):
    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation)
        family.add_metric([], self._read())
        yield family


class _KvCollector(Collector):
    def __init__(self, kv_store: TieredKvStore, kv_pipeline: KvPipeline) -> None:
        self._kv_store = kv_store
        self._kv_pipeline = kv_pipeline

    def collect(self) -> Iterator[Metric]:
        tier_gauges = {
            "entries": GaugeMetricFamily("inferscale_kv_tier_entries", "KV blobs held, by tier", labels=["tier"]),
            "bytes": GaugeMetricFamily("inferscale_kv_tier_bytes", "KV bytes held, by tier", labels=["tier"]),
        }
        budget = GaugeMetricFamily("inferscale_kv_tier_budget_bytes", "KV byte budget, by tier", labels=["tier"])
        tier_counters = {
            "hits": CounterMetricFamily("inferscale_kv_tier_hits", "KV lookups found in the tier", labels=["tier"]),
            "lookups": CounterMetricFamily("inferscale_kv_tier_lookups", "KV lookups in the tier", labels=["tier"]),
            "evictions": CounterMetricFamily("inferscale_kv_tier_evictions", "KV blobs evicted", labels=["tier"]),
        }
        for tier in self._kv_store.tiers:
            for name, family in (tier_gauges | tier_counters).items():
                family.add_metric([tier.name], getattr(tier.stats, name))
            budget.add_metric([tier.name], tier.budget_bytes)
        yield from tier_gauges.values()
        yield budget
        yield from tier_counters.values()
        requests = CounterMetricFamily("inferscale_object_store_requests", "requests to the shared object store "
                                       "for fact KV (LanceDB's own are not counted)")
        requests.add_metric([], getattr(self._kv_store.durable, "requests", 0))
        yield requests
        read = CounterMetricFamily("inferscale_kv_bytes_read", "fact KV bytes read for FetchKv, by tier (the host "
                                   "cache, or the durable tier on a miss; concurrent misses of a blob share one read)",
                                   labels=["tier"])
        for tier_name, read_bytes in self._kv_store.bytes_read.items():
            read.add_metric([tier_name], read_bytes)
        yield read
        served = CounterMetricFamily("inferscale_kv_bytes_served", "fact KV bytes handed to FetchKv")
        served.add_metric([], self._kv_store.bytes_served)
        yield served
        corrupt = CounterMetricFamily("inferscale_kv_corrupt_blobs", "durable-tier blobs that failed their checksum")
        corrupt.add_metric([], self._kv_store.corrupt_blobs)
        yield corrupt
        waiting = GaugeMetricFamily("inferscale_kv_audits_waiting", "stored KV waiting for another worker's audit")
        waiting.add_metric([], self._kv_pipeline.audits_waiting())
        yield waiting
        awaiting = GaugeMetricFamily("inferscale_kv_profiles_awaiting_header", "profiles whose memory header no two "
                                     "worker identities agree on yet: their memory is served as text")
        awaiting.add_metric([], self._kv_pipeline.profiles_awaiting_header())
        yield awaiting
        lost = CounterMetricFamily("inferscale_kv_lost_blobs", "indexed blobs whose durable copy was gone when read "
                                   "(their facts are computed again)")
        lost.add_metric([], self._kv_store.lost_blobs)
        yield lost
        queue = GaugeMetricFamily("inferscale_kv_queue_facts", "facts in the KV pipeline by profile and state",
                                  labels=["profile_id", "state"])
        lag = GaugeMetricFamily("inferscale_kv_queue_lag_seconds", "age of the oldest queued fact",
                                labels=["profile_id"])
        for profile_id in self._kv_pipeline.profiles():
            counts = self._kv_pipeline.counts(profile_id)
            for state in ("queued", "leased", "done", "failed"):
                queue.add_metric([profile_id, state], getattr(counts, state))
            lag.add_metric([profile_id], counts.lag_seconds)
        yield queue
        yield lag
        capacity = GaugeMetricFamily("inferscale_worker_facts_per_second", "a precompute worker's capacity: facts "
                                     "encoded per second of encoding, as it last reported", labels=["worker_id"])
        device_used = GaugeMetricFamily("inferscale_worker_device_memory_used_bytes", "a precompute worker's device "
                                        "memory in use, as it last reported", labels=["worker_id"])
        device_total = GaugeMetricFamily("inferscale_worker_device_memory_total_bytes", "a precompute worker's "
                                         "device memory", labels=["worker_id"])
        utilization = GaugeMetricFamily("inferscale_worker_device_utilization_percent", "a precompute worker's "
                                        "device utilization, as it last reported", labels=["worker_id"])
        for worker in self._kv_pipeline.recent_workers(WORKER_METRICS_WINDOW_S):
            capacity.add_metric([worker.worker_id], worker.facts_per_second)
            if worker.device:
                device_used.add_metric([worker.worker_id], worker.device.memory_used_bytes)
                device_total.add_metric([worker.worker_id], worker.device.memory_total_bytes)
                utilization.add_metric([worker.worker_id], worker.device.utilization_percent)
        yield from (capacity, device_used, device_total, utilization)
