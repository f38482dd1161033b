"""InferScale's vLLM KV connector (v1 API): loads the memory prefix (header + facts) of a request from
precomputed, pre-RoPE fact KV instead of prefilling it.

Roles talk only through `InferScaleConnectorMetadata`:
- Scheduler (EngineCore process): `get_num_new_matched_tokens` claims the longest prefix of the prompt that
  the middleware's plan *proves*: the header and then each fact's stored token ids must equal the prompt's
  token ids at their offsets; the claim stops at the first mismatch and never exceeds prompt_len - 1.
  The method is cheap and keeps no state; it may be called any number of times per request.
  `update_state_after_alloc` records the load; `build_connector_meta` hands it to the workers exactly once,
  also when a preempted request resumes (then with all of its new block ids).
  A load is *synchronous* when the scheduler's residency hint says that every chunk is in the node cache
  (written before this step's forward), else *asynchronous*: the request waits in WAITING_FOR_REMOTE_KVS
  while a fetch thread streams the misses from the memory service, and is scheduled once `get_finished`
  reports it (set `async_loads` off to fetch inline instead).
- Worker: `start_load_kv` stages each load's chunks (node cache, else fetch: `staging.KvStager`), composes
  the prefix (gather + RoPE at the final positions with the model's own tables) and writes it into the
  request's blocks: on CUDA with the cache in the model dtype one fused Triton kernel does both
  (`compose.compose_into_cache`), elsewhere torch ops compose (`compose.compose_prefix`) and each attention
  layer's own `do_kv_cache_update` writes (CPU's packed layout, fp8 caches). Async loads are fetched on a thread and written in `get_finished` of a later step.
  Nothing raises into the engine: a failed load is reported by `get_block_ids_with_load_errors` (for an async
  load no later than the step that reports it finished) and, with kv_load_failure_policy="recompute", vLLM
  prefills those tokens itself. Counts reach Prometheus through vLLM's connector stats (`connector_stats`).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from inference_node.compose import ChunkSlice, PagedCaches, compose_into_cache, compose_prefix
from inference_node.connector_stats import ConnectorPromMetrics, LoadStats
from inference_node.node_cache import CachedKv, NodeKvCache, ResidencyHint
from inference_node.settings import HEADER_CHUNK, PARAMS_KEY, NodeSettings
from inference_node.staging import ChunkRef, KvStager, StagedChunks, chunk_key
from inference_node.tensor_parallel import UNSHARDED, KvHeadShard, current_shard
from inferscale_kv.rope import RotaryTables
from inferscale_kv.shape import KvShape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class ChunkLoad(ChunkRef):
    """One chunk of the memory prefix (the header or a fact) at prompt positions [offset, offset + len)."""

    offset: int


@dataclass(frozen=True)
class LoadSpec:
    request_id: str
    profile_id: str
    user_id: str
    chunks: tuple[ChunkLoad, ...]
    start: int  # first prompt position to write (tokens before it are in vLLM's prefix cache)
    end: int  # one past the last position to write
    block_ids: tuple[int, ...]
    load_async: bool = False


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


def provable_prefix(prompt_token_ids: list[int], params: Any, profile_id: str) -> tuple[int, list[ChunkLoad]]:
    """Length of the prompt prefix whose KV the plan can supply, and the chunks covering it.

    Runs in the scheduler: a malformed plan claims nothing, it never raises.
    """
    try:
        plan = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if not isinstance(plan, dict) or plan.get("profile_id") != profile_id or not plan.get("user_id"):
            return 0, []
        offset, chunks = 0, []
        for chunk in plan.get("chunks", []):
            token_ids = chunk["token_ids"]
            if not token_ids or prompt_token_ids[offset : offset + len(token_ids)] != token_ids:
                break
            chunks.append(ChunkLoad(str(chunk["fact_id"]), int(chunk["version"]), tuple(token_ids), offset))
            offset += len(token_ids)
    except (TypeError, KeyError, ValueError, AttributeError):
        return 0, []
    if not chunks or chunks[0].fact_id != HEADER_CHUNK:
        return 0, []
    return min(offset, len(prompt_token_ids) - 1), chunks


class InferScaleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.settings = NodeSettings.from_mapping(extra)
        self.profile_id = self.settings.profile_id
        self.block_size = vllm_config.cache_config.block_size
        self._cache_dtype_is_model_dtype = vllm_config.cache_config.cache_dtype == "auto"
        self._model_config = vllm_config.model_config
        tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
        # Scheduler side: loads decided by update_state_after_alloc, not yet sent to the workers.
        self._pending: dict[str, LoadSpec] = {}
        self._resident = ResidencyHint(self.settings.node_cache_mb << 20,
                                       _bytes_per_token_per_rank(self._model_config, tensor_parallel_size))
        # Worker side.
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 cos, sin on the device
        self._layers: dict[int, Any] | None = None
        self._cache = NodeKvCache(self.settings.node_cache_mb << 20)
        shard = current_shard(tensor_parallel_size) if role == KVConnectorRole.WORKER else UNSHARDED
        self._stager = KvStager(self.settings, self._cache, self._model_config.hf_config, shard)
        self._fetcher: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[LoadSpec, Future]] = {}
        self._failed_blocks: set[int] = set()
        self._stats = LoadStats()
        self._last_misses = 0
        self._phase_ends: dict[str, float] = {}

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Side-effect free; the same answer for the same request within a scheduling step."""
        end, chunks = provable_prefix(request.prompt_token_ids or [], request.kv_transfer_params, self.profile_id)
        claim = max(0, end - num_computed_tokens)
        return claim, claim > 0 and self._loads_async(request, chunks)

    def _loads_async(self, request: Request, chunks: list[ChunkLoad]) -> bool:
        if not self.settings.async_loads:
            return False
        user_id = request.kv_transfer_params[PARAMS_KEY]["user_id"]
        return any(chunk_key(self.profile_id, user_id, chunk) not in self._resident for chunk in chunks)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            self._pending.pop(request.request_id, None)
            return
        end, chunks = provable_prefix(request.prompt_token_ids or [], request.kv_transfer_params, self.profile_id)
        load_async = self._loads_async(request, chunks)
        # An async request is not scheduled this step: its blocks are known only here.
        block_ids = tuple(blocks.get_block_ids()[0]) if load_async else ()
        self._pending[request.request_id] = LoadSpec(
            request_id=request.request_id, profile_id=self.profile_id,
            user_id=request.kv_transfer_params[PARAMS_KEY]["user_id"], chunks=tuple(chunks),
            start=end - num_external_tokens, end=end, block_ids=block_ids, load_async=load_async)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = InferScaleConnectorMetadata()
        for req_id in [r for r, spec in self._pending.items() if spec.load_async]:
            metadata.loads.append(self._pending.pop(req_id))
        for new in scheduler_output.scheduled_new_reqs:
            spec = self._pending.pop(new.req_id, None)
            if spec is not None:
                metadata.loads.append(_with_blocks(spec, new.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        legacy_resumed = getattr(cached, "resumed_from_preemption", None)  # vLLM releases before resumed_req_ids
        for index, req_id in enumerate(cached.req_ids):
            spec = self._pending.pop(req_id, None)
            if spec is None:
                continue
            is_resumed = req_id in resumed or bool(legacy_resumed and legacy_resumed[index])
            new_block_ids = cached.new_block_ids[index]
            if is_resumed and new_block_ids is not None:
                # A resumed request gets all of its blocks anew: its memory prefix is loaded again.
                metadata.loads.append(_with_blocks(spec, new_block_ids[0]))
        # After every decision of this step, so that the hint is constant while the step schedules.
        for spec in metadata.loads:
            for chunk in spec.chunks:
                self._resident.record(chunk_key(spec.profile_id, spec.user_id, chunk), len(chunk.token_ids))
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LoadStats | None:
        return LoadStats(data=dict(data)) if data is not None else LoadStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ConnectorPromMetrics:
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Writes every synchronous load before this step's forward and starts the fetch of every async one.
        Never raises: a failure marks the load's blocks for recompute."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, InferScaleConnectorMetadata):
            return
        for spec in metadata.loads:
            self._stats.add("loads")
            if spec.load_async:
                self._start_async(spec, forward_context)
                continue
            try:
                if self.settings.load_stats_path and torch.cuda.is_available():
                    torch.cuda.synchronize()  # benchmark mode: time this load's work alone
                started = time.perf_counter()
                layers = self._attention_layers(forward_context)
                device = _layer_cache(next(iter(layers.values()))).device
                staged = self._count(self._stage(spec, device))
                self._mark("stage")
                self._write(spec, staged, layers)
                if self.settings.load_stats_path:
                    self._record_load(spec, started)
            except Exception:  # noqa: BLE001 - never into the engine: report, and vLLM recomputes
                self._fail(spec)

    def _start_async(self, spec: LoadSpec, forward_context: ForwardContext) -> None:
        try:
            layers = self._attention_layers(forward_context)
            device = _layer_cache(next(iter(layers.values()))).device
            if self._fetcher is None:
                self._fetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="inferscale-fetch")
            compute_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
            self._inflight[spec.request_id] = (spec, self._fetcher.submit(self._stage, spec, device, compute_stream))
        except Exception as exc:  # noqa: BLE001 - reported as a failed load in get_finished
            self._inflight[spec.request_id] = (spec, _failed_future(exc))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Writes the async loads whose fetch is done and reports them (failed ones too, with their blocks in
        get_block_ids_with_load_errors of this same step)."""
        done = set()
        for req_id, (spec, future) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            done.add(req_id)
            self._stats.add("async_loads")
            try:
                self._write(spec, self._count(future.result()), self._layers)
            except Exception:  # noqa: BLE001
                self._fail(spec)
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> LoadStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, LoadStats()
        return stats

    def shutdown(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ loading

    def _fail(self, spec: LoadSpec) -> None:
        logger.exception("InferScale: KV load failed for request %s; it will be recomputed", spec.request_id)
        self._stats.add("load_failures")
        first, last = spec.start // self.block_size, (spec.end - 1) // self.block_size
        self._failed_blocks.update(spec.block_ids[first : last + 1])

    def _mark(self, phase: str) -> None:
        """Benchmark mode only: the time at the end of a load phase (after the device finished it)."""
        if self.settings.load_stats_path:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._phase_ends[phase] = time.perf_counter()

    def _record_load(self, spec: LoadSpec, started: float) -> None:
        ends = self._phase_ends
        record = {"request_id": spec.request_id, "tokens": spec.end - spec.start, "chunks": len(spec.chunks),
                  "ms": (ends["write"] - started) * 1000, "node_cache_misses": self._last_misses,
                  "stage_ms": (ends["stage"] - started) * 1000, "compose_ms": (ends["compose"] - ends["stage"]) * 1000,
                  "write_ms": (ends["write"] - ends["compose"]) * 1000}
        with open(self.settings.load_stats_path, "a") as stats_file:
            stats_file.write(json.dumps(record) + "\n")

    def _stage(self, spec: LoadSpec, device: torch.device, compute_stream=None) -> StagedChunks:
        """The chunks' KV in the node cache (fetching misses); runs on the engine thread or a fetch thread."""
        if device.type == "cuda" and compute_stream is None:
            compute_stream = torch.cuda.current_stream(device)
        return self._stager.stage(spec.profile_id, spec.user_id, spec.chunks, device, self._model_config.dtype,
                                  compute_stream)

    def _count(self, staged: StagedChunks) -> list[CachedKv]:
        """Records a staging's lookups (engine thread only: the stats object is not shared with fetch threads)."""
        self._last_misses = staged.lookups - staged.hits
        self._stats.add("node_cache_lookups", staged.lookups)
        self._stats.add("node_cache_hits", staged.hits)
        self._stats.add("facts_fetched", staged.lookups - staged.hits)
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

    def _write(self, spec: LoadSpec, entries: list[CachedKv], layers: dict[int, Any]) -> None:
        """Composes the load's span [start, end) and writes it into the request's blocks (engine thread only)."""
        device = _layer_cache(next(iter(layers.values()))).device
        slices = []
        for chunk, entry in zip(spec.chunks, entries):
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
        if self._cache_dtype_is_model_dtype and caches.writable_by_kernel(self._model_config.dtype):
            compose_into_cache(slices, spec.start, *self._rope, caches)  # compose and cache writes in one launch
            self._mark("compose")
            self._stats.add("tokens_loaded", count)
            self._mark("write")
            return
        keys, values = compose_prefix(slices, spec.start, *self._rope, len(layers))
        positions = torch.arange(spec.start, spec.end)
        block_table = torch.tensor(spec.block_ids, dtype=torch.int64)
        slots = block_table[positions // self.block_size] * self.block_size + positions % self.block_size
        if device.type == "cuda":
            slots = slots.pin_memory()
        slots = slots.to(device, non_blocking=True)
        self._mark("compose")
        for index, layer in layers.items():
            expected = (count, layer.num_kv_heads, layer.head_size)
            if tuple(keys[index].shape) != expected:
                raise ValueError(f"layer {index}: KV shape {tuple(keys[index].shape)} != {expected}")
            layer.impl.do_kv_cache_update(layer, keys[index], values[index], _layer_cache(layer), slots)
        self._stats.add("tokens_loaded", count)
        self._mark("write")


def _bytes_per_token_per_rank(model_config: Any, tensor_parallel_size: int) -> int:
    """KV bytes of one token in one rank's node cache (every rank holds the same number of heads)."""
    rank_shape = KvHeadShard(0, tensor_parallel_size).of(KvShape.from_config(model_config.hf_config))
    return rank_shape.elements_per_token() * model_config.dtype.itemsize


def _failed_future(error: Exception) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def _layer_cache(layer: Any) -> torch.Tensor:
    cache = layer.kv_cache
    if isinstance(cache, (list, tuple)):
        cache = cache[0]  # one virtual engine: InferScale does not run with pipeline parallelism
    return cache


def _with_blocks(spec: LoadSpec, block_ids: list[int]) -> LoadSpec:
    return LoadSpec(spec.request_id, spec.profile_id, spec.user_id, spec.chunks, spec.start, spec.end,
                    tuple(block_ids), spec.load_async)
