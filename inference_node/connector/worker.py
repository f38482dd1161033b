"""The connector's worker role: stages each load's chunks (node cache; for async loads also fetches), composes the
prefix (gather + RoPE at the final positions with the model's own tables) and writes it into the request's blocks.

On CUDA with the cache in the model dtype one fused Triton kernel does both (`compose.compose_into_cache`);
elsewhere torch ops compose (`compose.compose_prefix`) and each attention layer's own `do_kv_cache_update`
writes (CPU's packed layout, fp8 caches). Async loads are fetched on a thread and written in `get_finished` of a
later step. Nothing raises into the engine: a failure marks the load's blocks for recompute. Counts reach
Prometheus through vLLM's connector stats (stats.py). Where missing KV comes from and whether loads are timed are
chosen once, when the worker is built (`from_settings`: kv_source.py, load_timer.py).
"""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from inference_node.connector.compose import ChunkSlice, PagedCaches, compose_into_cache, compose_prefix
from inference_node.connector.kv_source import KvSource, kv_source
from inference_node.connector.load_timer import LoadTimer, load_timer
from inference_node.connector.metadata import InferScaleConnectorMetadata, LoadSpec
from inference_node.connector.node_cache import CachedKv, NodeKvCache
from inference_node.connector.staging import KvStager, NotResident, StagedChunks
from inference_node.connector.stats import LoadStats
from inference_node.connector.tensor_parallel import current_shard
from inference_node.settings import NodeSettings
from inferscale_kv.rope import RotaryTables

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = init_logger(__name__)
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class InferScaleWorker:
    def __init__(self, vllm_config: VllmConfig, source: KvSource, timer: LoadTimer) -> None:
        self.block_size = vllm_config.cache_config.block_size
        self._cache_dtype_is_model_dtype = vllm_config.cache_config.cache_dtype == "auto"
        self._model_config = vllm_config.model_config
        if not isinstance(self._model_config.dtype, torch.dtype):
            raise TypeError(f"InferScaleConnector: model dtype {self._model_config.dtype!r} is not resolved")
        self._dtype: torch.dtype = self._model_config.dtype
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 cos, sin on the device
        self._layers: dict[int, Any] | None = None
        self._cache = NodeKvCache()
        self._stager = KvStager(self._cache, source)
        self._timer = timer
        self._fetcher: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[LoadSpec, Future[StagedChunks]]] = {}
        self._staging_ms: dict[str, float] = {}  # async loads staged from the node cache: their staging time
        self._failed_blocks: set[int] = set()
        self._stats = LoadStats()

    @classmethod
    def from_settings(cls, vllm_config: VllmConfig, settings: NodeSettings) -> InferScaleWorker:
        """The worker of this rank with the KV source and load timer the node's settings ask for: the memory
        service or synthetic KV (`synthetic_kv`), untimed or JSON-lines records (`load_stats_path`)."""
        shard = current_shard(vllm_config.parallel_config.tensor_parallel_size)
        return cls(vllm_config, kv_source(settings, vllm_config.model_config.hf_config, shard), load_timer(settings))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, metadata: InferScaleConnectorMetadata, forward_context: ForwardContext) -> None:
        """Applies the directory's evictions, writes every synchronous load before this step's forward (from the
        node cache only) and starts the fetch of every async one. Never raises."""
        self._cache.remove(metadata.evictions)
        for spec in metadata.loads:
            self._stats.add("loads")
            if spec.load_async:
                self._start_async(spec, forward_context)
                continue
            try:
                started = self._timer.now()
                layers = self._attention_layers(forward_context)
                device = _layer_cache(next(iter(layers.values()))).device
                staged = self._stage(spec, device, may_fetch=False)
                entries = self._count(staged)
                staged_at = self._timer.now()
                self._write(spec, entries, layers)
                self._timer.record(spec, (staged_at - started) * 1000, staged_at, staged.misses)
            except NotResident as exc:
                self._stats.add("sync_misses")
                self._fail(spec, str(exc))
            except Exception:  # never into the engine: report, and vLLM recomputes
                logger.exception("InferScale: KV load failed for request %s", spec.request_id)
                self._fail(spec, "see the traceback above")

    def _start_async(self, spec: LoadSpec, forward_context: ForwardContext) -> None:
        """Stages at once what the node cache holds (done by this step's get_finished), else fetches on a thread."""
        try:
            layers = self._attention_layers(forward_context)
            device = _layer_cache(next(iter(layers.values()))).device
            try:
                started = self._timer.now()
                self._inflight[spec.request_id] = (spec, _done_future(self._stage(spec, device, may_fetch=False)))
                self._staging_ms[spec.request_id] = (self._timer.now() - started) * 1000
                return
            except NotResident:
                pass
            if self._fetcher is None:
                self._fetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="inferscale-fetch")
            compute_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            self._inflight[spec.request_id] = (spec, self._fetcher.submit(self._stage, spec, device, True,
                                                                          compute_stream))
        except Exception as exc:  # reported as a failed load in get_finished
            self._inflight[spec.request_id] = (spec, _failed_future(exc))

    def get_finished(self) -> set[str] | None:
        """Writes the async loads whose fetch is done and reports them (failed ones too, with their blocks in
        get_block_ids_with_load_errors of this same step)."""
        done = set()
        for req_id, (spec, future) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            done.add(req_id)
            self._stats.add("async_loads")
            staging_ms = self._staging_ms.pop(req_id, None)  # None: fetched
            try:
                staged = future.result()
                entries = self._count(staged)
                write_started = self._timer.now()
                self._write(spec, entries, self._seen_layers())
                if staging_ms is not None:
                    self._timer.record(spec, staging_ms, write_started, staged.misses)
            except Exception:  # never into the engine: report, and vLLM recomputes
                logger.exception("InferScale: async KV load failed for request %s", spec.request_id)
                self._fail(spec, "see the traceback above")
        return done or None

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_stats(self) -> LoadStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, LoadStats()
        return stats

    def shutdown(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ loading

    def _fail(self, spec: LoadSpec, why: str) -> None:
        logger.warning("InferScale: KV load of request %s refused (%s); vLLM recomputes it", spec.request_id, why)
        self._stats.add("load_failures")
        first, last = spec.start // self.block_size, (spec.end - 1) // self.block_size
        self._failed_blocks.update(spec.block_ids[first : last + 1])

    def _stage(self, spec: LoadSpec, device: torch.device, may_fetch: bool,
               compute_stream: torch.cuda.Stream | None = None) -> StagedChunks:
        """The chunks' KV from the node cache (fetching misses when `may_fetch`: fetch threads only)."""
        if device.type == "cuda" and compute_stream is None:
            compute_stream = torch.cuda.current_stream(device)
        return self._stager.stage(spec.user_id, spec.chunks, device, self._dtype, compute_stream, may_fetch)

    def _count(self, staged: StagedChunks) -> list[CachedKv]:
        """Records a staging's lookups (engine thread only: the stats object is not shared with fetch threads)."""
        self._stats.add("node_cache_lookups", staged.lookups)
        self._stats.add("node_cache_hits", staged.hits)
        self._stats.add("facts_fetched", staged.misses)
        return staged.entries

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

    def _seen_layers(self) -> dict[int, Any]:
        """The attention layers found by an earlier start_load_kv (every async load's start looked them up)."""
        if self._layers is None:
            raise RuntimeError("no attention layers seen yet")
        return self._layers

    def _write(self, spec: LoadSpec, entries: list[CachedKv], layers: dict[int, Any]) -> None:
        """Composes the load's span [start, end) and writes it into the request's blocks (engine thread only).
        Every slice is bounds-checked against its entry (ChunkSlice) before a kernel reads it."""
        device = _layer_cache(next(iter(layers.values()))).device
        slices = []
        for chunk, entry in zip(spec.chunks, entries, strict=True):
            if entry.token_ids != chunk.token_ids:
                raise ValueError(f"{chunk.key}: cached KV holds other token ids than the prompt's")
            lo, hi = max(spec.start, chunk.offset), min(spec.end, chunk.offset + len(chunk.token_ids))
            if lo < hi:
                slices.append(ChunkSlice(entry.keys, entry.values, lo - chunk.offset, hi - chunk.offset))
        count = spec.end - spec.start
        if sum(s.end - s.begin for s in slices) != count or min(e.keys.shape[0] for e in entries) < len(layers):
            raise ValueError(f"KV of {len(entries)} chunks does not cover {count} tokens x {len(layers)} layers")
        if self._rope is None:
            tables = RotaryTables.from_config(self._model_config.hf_config, self._model_config.max_model_len, device)
            self._rope = (tables.cos.float().contiguous(), tables.sin.float().contiguous())
        caches = PagedCaches([_layer_cache(layer) for layer in layers.values()], spec.block_ids, self.block_size)
        if self._cache_dtype_is_model_dtype and caches.writable_by_kernel(self._dtype):
            compose_into_cache(slices, spec.start, *self._rope, caches)  # compose and cache writes in one launch
            self._timer.mark("compose")
            self._stats.add("tokens_loaded", count)
            self._timer.mark("write")
            return
        keys, values = compose_prefix(slices, spec.start, *self._rope, len(layers))
        positions = torch.arange(spec.start, spec.end)
        block_table = torch.tensor(spec.block_ids, dtype=torch.int64)
        slots = block_table[positions // self.block_size] * self.block_size + positions % self.block_size
        if device.type == "cuda":
            slots = slots.pin_memory()
        slots = slots.to(device, non_blocking=True)
        self._timer.mark("compose")
        for index, layer in layers.items():
            expected = (count, layer.num_kv_heads, layer.head_size)
            if tuple(keys[index].shape) != expected:
                raise ValueError(f"layer {index}: KV shape {tuple(keys[index].shape)} != {expected}")
            layer.impl.do_kv_cache_update(layer, keys[index], values[index], _layer_cache(layer), slots)
        self._stats.add("tokens_loaded", count)
        self._timer.mark("write")


def _done_future(result: Any) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


def _failed_future(error: Exception) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def _layer_cache(layer: Any) -> torch.Tensor:
    cache = layer.kv_cache
    if isinstance(cache, (list, tuple)):
        cache = cache[0]  # one virtual engine: pipeline parallelism is refused at start
    return cache
