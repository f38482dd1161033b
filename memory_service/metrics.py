"""Prometheus metrics of the memory service, on their own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_requests = Counter(
            "inferscale_rpc_requests", "gRPC calls by method and status code", ["method", "code"],
            registry=self.registry,
        )
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
            "inferscale_embedding_duration_seconds", "time to embed one batch, by purpose", ["purpose"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.retrieval_duration = Histogram(
            "inferscale_retrieval_duration_seconds", "vector search time per query (excluding embedding)",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.facts_retrieved = Counter(
            "inferscale_facts_retrieved", "facts returned by SearchFacts and RetrieveAndStage",
            registry=self.registry,
        )

    def serve(self, port: int, host: str) -> None:
        """Exposes /metrics over HTTP on a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
