"""What the two roles send each other, once per step.

Scheduler to workers (`InferScaleConnectorMetadata`, pickled to every worker): the device-tier evictions the
directory decided, the chunks to copy from the host tier into the device tier, the host-tier evictions, the
synchronous loads to write before this step's forward, and the prefetches to start on the workers' fetch threads,
applied in that order. Workers to scheduler (`PrefetchReport`, summed across
tensor-parallel ranks by vLLM's output aggregator): the prefetched chunks each rank settled this step, and the bytes
and seconds each tier's transfers took (the miss policy's bandwidths).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from inference_node.plan import ChunkLoad
from inferscale_kv.kv_key import KvKey


@dataclass(frozen=True)
class LoadSpec:
    """One request's synchronous load: write the chunks' KV at prompt positions [start, end) into its blocks, from
    the node cache, before the forward of the step that admits the request."""

    request_id: str
    user_id: str
    chunks: tuple[ChunkLoad, ...]
    start: int  # first prompt position to write (tokens before it are in vLLM's prefix cache)
    end: int  # one past the last position to write
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PrefetchSpec:
    """Fetch these chunks (one user's facts, and maybe the header) into every rank's device tier, from its host tier
    where it holds them, else from the memory service; those of `keep_on_host` fetched from the service also stay in
    the host tier. With `to_device` False (a warm-up), bring `keep_on_host` into the host tier only. A rank whose
    fetch threads are still busy `start_within_s` after receiving it reports it failed without fetching (its waiters
    have given up by then)."""

    user_id: str
    chunks: tuple[ChunkLoad, ...]
    start_within_s: float = math.inf
    keep_on_host: frozenset[KvKey] = frozenset()
    to_device: bool = True
    # The gateway's token of the request it is fetched for (memory_service/user_tokens.py); never in a repr: vLLM
    # prints scheduler output, connector metadata included, when its engine fails.
    user_token: str = field(default="", repr=False)


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    evictions: tuple[KvKey, ...] = ()  # device-tier entries to drop first
    promotions: tuple[ChunkLoad, ...] = ()  # then copied from the host tier into the device tier (this step's loads)
    host_evictions: tuple[KvKey, ...] = ()  # then host-tier entries dropped
    loads: list[LoadSpec] = field(default_factory=list)  # then written, before the forward
    prefetches: list[PrefetchSpec] = field(default_factory=list)  # then started on the fetch threads


@dataclass
class PrefetchReport(KVConnectorWorkerMetadata):
    """Per chunk key, how many ranks finished prefetching it this step (fetched into their device tier, or failed),
    and warming it (into their host tier); per tier a transfer read from, the bytes it moved and the microseconds it
    took, summed over transfers and ranks."""

    fetched: Counter[KvKey] = field(default_factory=Counter)
    failed: Counter[KvKey] = field(default_factory=Counter)
    warmed: Counter[KvKey] = field(default_factory=Counter)
    warm_failed: Counter[KvKey] = field(default_factory=Counter)
    transfer_bytes: Counter[str] = field(default_factory=Counter)  # "host" (host to device), "source" (service)
    transfer_micros: Counter[str] = field(default_factory=Counter)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PrefetchReport:
        if isinstance(other, PrefetchReport):
            for mine, theirs in ((self.fetched, other.fetched), (self.failed, other.failed),
                                 (self.warmed, other.warmed), (self.warm_failed, other.warm_failed)):
                mine.update(theirs)
            self.transfer_bytes.update(other.transfer_bytes)
            self.transfer_micros.update(other.transfer_micros)
        return self

    def is_empty(self) -> bool:
        return not (self.fetched or self.failed or self.warmed or self.warm_failed or self.transfer_bytes)
