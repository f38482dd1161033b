"""The connector's telemetry, carried by vLLM's own channel: worker-side `LoadStats` travel with each model-runner
output to the scheduler, are summed across workers with the scheduler role's own, and reach the API server, where
`ConnectorPromMetrics` turns them into Prometheus counters on vLLM's /metrics (counters with their denominators:
hits and lookups, failures and loads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

COUNTERS = {
    "loads": "memory-prefix loads (a request's header + facts), each written before the forward of the step that "
             "admits its request",
    "async_loads": "loads whose request first waited for its chunks to be prefetched into the node cache",
    "load_failures": "requests whose memory could not be loaded (a prefetch failed, timed out or did not fit the node "
                     "cache, or a chunk's token ids disagreed): vLLM prefilled their prompt",
    "load_defects": "synchronous loads that failed in a worker (a defect): vLLM failed the request with an error",
    "tokens_loaded": "prompt tokens written from fact KV into the paged cache",
    "node_cache_lookups": "chunks requests needed when first asked for",
    "node_cache_hits": "of those, chunks already resident in the node cache",
    "facts_fetched": "chunks fetched from the memory service into a rank's node cache (per rank)",
    "source_bytes_fetched": "bytes of those chunks (this rank's heads; per rank)",
    "source_fetch_micros": "microseconds those fetches took, fetch, checks and decode (per rank)",
    "durable_tier_reads": "of those, chunks a rank's fetch process read from the memory service's durable tier "
                          "itself (--kv-durable-tier) instead of over FetchKv (per rank)",
    "host_tier_hits": "chunks a rank copied into its device tier from its host tier instead of fetching them",
    "host_bytes_copied": "bytes of those chunks (per rank)",
    "host_copy_micros": "microseconds those host-to-device copies took (per rank)",
    "partial_loads": "requests the miss policy served at once: the resident prefix of their memory loaded, the rest "
                     "prefilled by vLLM while its chunks were fetched in the background",
    "warmed_chunks": "chunks ordered into the host tier in the background: a user's next facts when the user's "
                     "request arrived (a warm-up), and what a partial load left out",
    "sync_misses": "synchronous loads that found a chunk missing from a rank's node cache (a defect; per rank)",
    "fetch_processes_started": "fetch processes the ranks started: one per rank as the worker starts, one more after "
                               "each that exited (its fetches in flight failed: their requests prefilled)",
    "plans_refused": "requests whose load plan was unsigned, altered, for another profile or salt, or with LoRA",
}


@dataclass
class LoadStats(KVConnectorStats):
    """Counts since the last report; `data` maps each name of COUNTERS to an int."""

    data: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def add(self, name: str, amount: int = 1) -> None:
        self.data[name] = self.data.get(name, 0) + amount

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> LoadStats:
        for name, amount in other.data.items():
            if name in COUNTERS:
                self.add(name, int(amount))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class ConnectorPromMetrics(KVConnectorPromMetrics):
    """`inferscale_connector_<name>_total` counters, one per vLLM engine label set."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, _Counter]] = {}
        for name, documentation in COUNTERS.items():
            counter = self._counter_cls(name=f"inferscale_connector_{name}", documentation=documentation,
                                        labelnames=labelnames)
            # vLLM types its counter class as any Prometheus metric; the one it hands for Counter counts.
            self._counters[name] = {engine: cast(_Counter, counter.labels(*values))
                                    for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, amount in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and amount and engine_idx in per_engine:
                per_engine[engine_idx].inc(amount)
