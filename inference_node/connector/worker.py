"""The connector's worker role: writes the step's synchronous loads (gather + RoPE at each token's final position
with the model's own tables) into the requests' blocks from the node cache's device tier before the step's forward,
every load of the step in one batched write (the host-tier chunks the step's loads need copied back into it first,
in stream order), and prefetches chunks into its tiers on fetch threads (residency.py), reporting each settled
chunk, and each tier's bytes and time, to the scheduler role.

On CUDA with the cache in the model dtype one fused Triton kernel launch composes and writes every load
(`compose.compose_into_cache`); elsewhere torch ops compose them together (`compose.compose_for_slots`) and each
attention layer's own `do_kv_cache_update` writes them in one call per layer (CPU's packed layout, fp8 caches). The
engine thread never waits on the network: it only starts prefetches and polls them. Nothing raises into the engine:
a load that fails (a defect, the scheduler proved its chunks resident) reports its blocks, and vLLM fails the
request (kv_load_failure_policy="fail"). Counts reach Prometheus through vLLM's connector stats (stats.py). Where
missing KV comes from and whether loads are timed are chosen once, when the worker is built (`from_settings`:
kv_source.py, load_timer.py).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from inference_node.connector.compose import ChunkSlice, PagedCaches, PagedLoad, compose_for_slots, compose_into_cache
from inference_node.connector.kv_source import KvSource, kv_source
from inference_node.connector.load_timer import LoadTimer, load_timer
from inference_node.connector.metadata import InferScaleConnectorMetadata, LoadSpec, PrefetchReport, PrefetchSpec
from inference_node.connector.node_cache import NodeKvCache
from inference_node.connector.residency import FetchCounts, KvResidency, NotResident
from inference_node.connector.stats import LoadStats
from inference_node.connector.tensor_parallel import UNSHARDED, KvHeadShard, current_shard
from inference_node.kv_fetch import CachedKv
from inference_node.plan import ChunkLoad
from inference_node.settings import NodeSettings
from inferscale_kv.rope import RotaryTables
from inferscale_kv.shape import KvShape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = init_logger(__name__)
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
FETCH_THREADS = 2
# The most tokens the torch path composes at once (one step's loads are split into groups of at most this many).
TOKENS_PER_COMPOSE = 8192


class InferScaleWorker:
    def __init__(self, vllm_config: VllmConfig, source: KvSource, timer: LoadTimer,
                 shard: KvHeadShard = UNSHARDED) -> None:
        self.block_size = vllm_config.cache_config.block_size
        self._cache_dtype_is_model_dtype = vllm_config.cache_config.cache_dtype == "auto"
        self._model_config = vllm_config.model_config
        if not isinstance(self._model_config.dtype, torch.dtype):
            raise TypeError(f"InferScaleConnector: model dtype {self._model_config.dtype!r} is not resolved")
        self._dtype: torch.dtype = self._model_config.dtype
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 cos, sin on the device
        self._layers: dict[int, Any] | None = None
        self._cache = NodeKvCache()
        self._host_cache = NodeKvCache()
        self._counts_loads = shard.rank == 0  # every rank writes its heads of each load: one counts it for the node
        self._source = source
        self._processes_counted = 0  # of the source's fetch processes, those counted in the stats so far
        self._durable_reads_counted = 0  # of the source's durable-tier reads, those counted so far
        self._residency = KvResidency(self._cache, self._host_cache, source,
                                      shard.of(KvShape.from_config(self._model_config.hf_config)))
        self._timer = timer
        self._fetcher: ThreadPoolExecutor | None = None
        self._warmer: ThreadPoolExecutor | None = None
        self._prefetching: list[tuple[PrefetchSpec, Future[FetchCounts]]] = []
        self._promoted: list[tuple[int, int, _CopyTiming]] = []  # chunks, bytes, timing: not yet counted
        self._failed_blocks: set[int] = set()
        self._stats = LoadStats()

    @classmethod
    def from_settings(cls, vllm_config: VllmConfig, settings: NodeSettings) -> InferScaleWorker:
        """The worker of this rank with the KV source and load timer the node's settings ask for: the memory
        service or synthetic KV (`synthetic_kv`), untimed or JSON-lines records (`load_stats_path`)."""
        shard = current_shard(vllm_config.parallel_config.tensor_parallel_size)
        return cls(vllm_config, kv_source(settings, vllm_config.model_config.hf_config, shard), load_timer(settings),
                   shard)

    def start_load_kv(self, metadata: InferScaleConnectorMetadata, forward_context: ForwardContext) -> None:
        """Applies the directory's device evictions, copies the step's promotions from the host tier, applies its
        host evictions, writes every load before this step's forward (from the device tier only; all of them in one
        batched write, each checked on its own first), then starts the step's prefetches on the fetch threads. Never
        raises; never waits on the network or a copy."""
        self._cache.remove(metadata.evictions)
        if metadata.promotions:
            self._promote(metadata.promotions, forward_context)
        self._host_cache.remove(metadata.host_evictions)
        ready: list[_ReadyLoad] = []
        for spec in metadata.loads:
            if self._counts_loads:
                self._stats.add("loads")
            try:
                started = self._timer.now()
                layers = self._attention_layers(forward_context)
                load = self._paged_load(spec, self._residency.resident(spec.chunks), layers)
                ready.append(_ReadyLoad(spec, load, (self._timer.now() - started) * 1000))
            except NotResident as exc:
                self._stats.add("sync_misses")
                self._fail(spec, str(exc))
            except Exception as exc:  # never into the engine: report the blocks; vLLM fails the request
                logger.exception("InferScale defect: the KV load of request %s raised", spec.request_id)
                self._fail(spec, repr(exc))
        if ready:
            self._write_step(ready, layers)
        for prefetch in metadata.prefetches:
            self._start_prefetch(prefetch, forward_context)

    def _promote(self, chunks: tuple[ChunkLoad, ...], forward_context: ForwardContext) -> None:
        """Copies the step's promotions from the host tier into the device tier, ahead of its loads on the compute
        stream; timed by events the next reports read once the copy is done. Never raises: a chunk left out fails
        the load that needs it."""
        try:
            device = _layer_cache(next(iter(self._attention_layers(forward_context).values()))).device
            timing = _CopyTiming(device)
            copied, num_bytes = self._residency.promote(chunks, device)
            timing.stop()
        except Exception:
            logger.exception("InferScale defect: copying %d chunks from the host tier raised", len(chunks))
            return
        self._promoted.append((copied, num_bytes, timing))

    def _start_prefetch(self, spec: PrefetchSpec, forward_context: ForwardContext) -> None:
        """Fetches the chunks into the node cache on a fetch thread (reported by build_worker_meta)."""
        future: Future[FetchCounts]
        try:
            device = _layer_cache(next(iter(self._attention_layers(forward_context).values()))).device
            compute_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            future = self._executor(spec).submit(self._fetch, spec, time.monotonic() + spec.start_within_s, device,
                                                 compute_stream)
        except Exception as exc:  # reported as a failed prefetch
            future = Future()
            future.set_exception(exc)
        self._prefetching.append((spec, future))

    def _executor(self, spec: PrefetchSpec) -> ThreadPoolExecutor:
        """The fetch threads for what a request waits for or its next request needs; one thread of its own for
        warm-ups, so that they never hold a fetch thread a request waits for."""
        if not spec.to_device:
            if self._warmer is None:
                self._warmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferscale-warm")
            return self._warmer
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="inferscale-fetch")
        return self._fetcher

    def _fetch(self, spec: PrefetchSpec, start_by: float, device: torch.device,
               compute_stream: torch.cuda.Stream | None) -> FetchCounts:
        """A fetch thread's job: the prefetch, unless it waited for a thread past the time its waiters give up (a
        backlog of fetches nobody waits for would make every later cold request wait out its deadline)."""
        if time.monotonic() > start_by:
            raise TimeoutError(f"no fetch thread free within {spec.start_within_s:.1f} s")
        return self._residency.fetch(spec.user_id, spec.chunks, device, self._dtype, compute_stream,
                                     spec.keep_on_host, spec.to_device, spec.user_token)

    def build_worker_meta(self) -> PrefetchReport | None:
        """The prefetches that finished since the last step, fetched or failed (engine thread: only polls)."""
        report, running = PrefetchReport(), []
        for spec, future in self._prefetching:
            if not future.done():
                running.append((spec, future))
                continue
            keys = [chunk.key for chunk in spec.chunks] if spec.to_device else list(spec.keep_on_host)
            settled, failed = (report.fetched, report.failed) if spec.to_device else (report.warmed,
                                                                                        report.warm_failed)
            try:
                counts = future.result()
            except Exception as exc:
                logger.warning("InferScale: prefetch of %d chunks of user %s failed (%r); requests waiting for them "
                               "are prefilled", len(keys), spec.user_id, exc)
                failed.update(keys)
                continue
            settled.update(keys)
            self._count_transfers(counts, report if spec.to_device else None)
        self._prefetching = running
        pending = []
        for copied, num_bytes, timing in self._promoted:
            seconds = timing.seconds()
            if seconds is None:
                pending.append((copied, num_bytes, timing))
            else:
                self._count_transfers(FetchCounts(from_host=copied, host_bytes=num_bytes, host_seconds=seconds),
                                      report)
        self._promoted = pending
        return None if report.is_empty() else report

    def _count_transfers(self, counts: FetchCounts, report: PrefetchReport | None) -> None:
        """The per-tier counters, and in `report` the bandwidths the miss policy weighs (per rank, summed by vLLM;
        not a warm-up's, which shares the fetch path with the requests' fetches)."""
        for tier, chunks, num_bytes, seconds in (("host", counts.from_host, counts.host_bytes, counts.host_seconds),
                                                 ("source", counts.from_source, counts.source_bytes,
                                                  counts.source_seconds)):
            if report is not None and chunks:
                report.transfer_bytes[tier] += num_bytes
                report.transfer_micros[tier] += max(1, int(seconds * 1e6))
        for name, amount in (("host_tier_hits", counts.from_host), ("host_bytes_copied", counts.host_bytes),
                             ("host_copy_micros", int(counts.host_seconds * 1e6)),
                             ("facts_fetched", counts.from_source), ("source_bytes_fetched", counts.source_bytes),
                             ("source_fetch_micros", int(counts.source_seconds * 1e6))):
            self._stats.add(name, amount)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_stats(self) -> LoadStats | None:
        started, durable_reads = self._source.processes_started, self._source.durable_reads
        self._stats.add("fetch_processes_started", started - self._processes_counted)
        self._stats.add("durable_tier_reads", durable_reads - self._durable_reads_counted)
        self._processes_counted, self._durable_reads_counted = started, durable_reads
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, LoadStats()
        return stats

    def shutdown(self) -> None:
        for executor in (self._fetcher, self._warmer):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self._source.close()

    # ------------------------------------------------------------------ loading

    def _fail(self, spec: LoadSpec, why: str) -> None:
        logger.error("InferScale defect: the synchronous KV load of request %s failed (%s); vLLM fails the request",
                     spec.request_id, why)
        first, last = spec.start // self.block_size, (spec.end - 1) // self.block_size
        self._failed_blocks.update(spec.block_ids[first : last + 1])

    def _attention_layers(self, forward_context: ForwardContext) -> dict[int, Any]:
        if self._layers is None:
            layers = {}
            for name, layer in forward_context.no_compile_layers.items():
                match = _LAYER_INDEX.search(name)
                if match and hasattr(layer, "impl") and hasattr(layer, "kv_cache"):
                    layers[int(match.group(1))] = layer
            if not layers:
                raise RuntimeError("no attention layers in the forward context")
            self._layers = dict(sorted(layers.items()))
        return self._layers

    def _paged_load(self, spec: LoadSpec, entries: list[CachedKv], layers: dict[int, Any]) -> PagedLoad:
        """The load's span [start, end) of its chunks' KV, every slice bounds-checked against its entry (ChunkSlice)
        and the whole against the request's blocks (inside the cache), the model's layers and length, and each
        layer's heads and dtype: ValueError, failing this load alone, before any kernel reads or writes."""
        num_layers, first = len(layers), next(iter(layers.values()))
        cache_blocks = _layer_cache(first).shape[0]
        slices = []
        for chunk, entry in zip(spec.chunks, entries, strict=True):
            if entry.token_ids != chunk.token_ids:
                raise ValueError(f"{chunk.key}: cached KV holds other token ids than the prompt's")
            if (entry.keys.dtype != self._dtype or tuple(entry.keys.shape[2:]) != (first.num_kv_heads, first.head_size)
                    or not (entry.keys.is_contiguous() and entry.values.is_contiguous())):
                raise ValueError(f"{chunk.key}: cached KV {tuple(entry.keys.shape)} {entry.keys.dtype} does not fit "
                                 f"the model's {first.num_kv_heads} x {first.head_size} {self._dtype} heads")
            lo, hi = max(spec.start, chunk.offset), min(spec.end, chunk.offset + len(chunk.token_ids))
            if lo < hi:
                slices.append(ChunkSlice(entry.keys, entry.values, lo - chunk.offset, hi - chunk.offset))
        count = spec.end - spec.start
        if sum(s.end - s.begin for s in slices) != count or min(e.keys.shape[0] for e in entries) < num_layers:
            raise ValueError(f"KV of {len(entries)} chunks does not cover {count} tokens x {num_layers} layers")
        if not 0 <= spec.start < spec.end <= min(len(spec.block_ids) * self.block_size,
                                                 self._model_config.max_model_len):
            raise ValueError(f"tokens [{spec.start}, {spec.end}) outside the request's {len(spec.block_ids)} blocks or "
                             "the model's length")
        used = spec.block_ids[spec.start // self.block_size : (spec.end - 1) // self.block_size + 1]
        if any(not 0 <= block < cache_blocks for block in used):
            raise ValueError(f"block ids {used} outside the cache's {cache_blocks} blocks")
        return PagedLoad(slices, spec.start, spec.block_ids)

    def _write_step(self, ready: list[_ReadyLoad], layers: dict[int, Any]) -> None:
        """Composes every ready load and writes them into their requests' blocks in one batch (engine thread only).
        A batch that raises fails each of its loads' requests (a defect: each load was checked)."""
        try:
            write_started = self._timer.now()
            self._write(ready, layers)
        except Exception as exc:  # never into the engine: report the blocks; vLLM fails the requests
            logger.exception("InferScale defect: the KV write of %d loads raised", len(ready))
            for load in ready:
                self._fail(load.spec, repr(exc))
            return
        for load in ready:
            if self._counts_loads:
                self._stats.add("tokens_loaded", load.spec.end - load.spec.start)
            try:
                self._timer.record(load.spec, load.lookup_ms, write_started, len(ready))
            except OSError:  # benchmarks only; the load itself is written
                logger.exception("InferScale: the load record of request %s was not written", load.spec.request_id)

    def _write(self, ready: list[_ReadyLoad], layers: dict[int, Any]) -> None:
        device = _layer_cache(next(iter(layers.values()))).device
        if self._rope is None:
            tables = RotaryTables.from_config(self._model_config.hf_config, self._model_config.max_model_len, device)
            self._rope = (tables.cos.float().contiguous(), tables.sin.float().contiguous())
        loads = [load.paged for load in ready]
        caches = PagedCaches([_layer_cache(layer) for layer in layers.values()], self.block_size)
        if self._cache_dtype_is_model_dtype and caches.writable_by_kernel(self._dtype):
            compose_into_cache(loads, *self._rope, caches)  # compose and cache writes in one launch
            self._timer.mark("compose")
            self._timer.mark("write")
            return
        for group in _groups_within(loads, TOKENS_PER_COMPOSE):
            keys, values, slots = compose_for_slots(group, *self._rope, len(layers), self.block_size)
            if device.type == "cuda":
                slots = slots.pin_memory()
            slots = slots.to(device, non_blocking=True)
            self._timer.mark("compose")
            for index, layer in layers.items():
                expected = (len(slots), layer.num_kv_heads, layer.head_size)
                if tuple(keys[index].shape) != expected:
                    raise ValueError(f"layer {index}: KV shape {tuple(keys[index].shape)} != {expected}")
                layer.impl.do_kv_cache_update(layer, keys[index], values[index], _layer_cache(layer), slots)
        self._timer.mark("write")


def _groups_within(loads: list[PagedLoad], tokens: int) -> list[list[PagedLoad]]:
    """The loads in order, in groups of at most `tokens` tokens (a longer load alone): the torch path's composed
    copies of a group live at once, outside the memory vLLM profiled."""
    groups: list[list[PagedLoad]] = []
    size = tokens
    for load in loads:
        if size + load.count > tokens:
            groups.append([])
            size = 0
        groups[-1].append(load)
        size += load.count
    return groups


@dataclass(frozen=True)
class _ReadyLoad:
    """A load of the step whose chunks are resident and checked: written with the step's others."""

    spec: LoadSpec
    paged: PagedLoad
    lookup_ms: float


class _CopyTiming:
    """How long copies issued on the current stream took: CUDA events read once they completed (never waited
    for), or wall time where copies are synchronous."""

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._started = time.perf_counter()
        self._seconds: float | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        if self._events is None:
            self._seconds = time.perf_counter() - self._started
        else:
            self._events[1].record()

    def seconds(self) -> float | None:
        """The copies' time, or None while they run."""
        if self._events is not None and self._seconds is None and self._events[1].query():
            self._seconds = self._events[0].elapsed_time(self._events[1]) / 1000
        return self._seconds


def _layer_cache(layer: Any) -> torch.Tensor:
    cache = layer.kv_cache
    if isinstance(cache, (list, tuple)):
        cache = cache[0]  # one virtual engine: pipeline parallelism is refused at start
    return cache
