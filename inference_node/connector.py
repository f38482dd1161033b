"""InferScale's vLLM KV connector (v1 API): loads the memory prefix (header + facts) of a request from
precomputed, pre-RoPE fact KV instead of prefilling it.

Roles talk only through `InferScaleConnectorMetadata`:
- Scheduler (EngineCore process): `get_num_new_matched_tokens` claims the longest prefix of the prompt that
  the middleware's plan *proves*: the header and then each fact's stored token ids must equal the prompt's
  token ids at their offsets; the claim stops at the first mismatch and never exceeds prompt_len - 1.
  The method is cheap and keeps no state; it may be called any number of times per request.
  `update_state_after_alloc` records the load; `build_connector_meta` hands it to the workers exactly once,
  also when a preempted request resumes (then with all of its new block ids).
- Worker: `start_load_kv` (synchronous, before the forward) takes each chunk's KV from the node cache (or
  fetches it from the memory service), rotates keys to their final positions with the model's own rotary
  tables, and writes them through each attention layer's own `do_kv_cache_update`. It never raises into the
  engine: a failed load is reported by `get_block_ids_with_load_errors` and, with
  kv_load_failure_policy="recompute", vLLM prefills those tokens itself.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from inference_node.node_cache import CachedKv, NodeKvCache
from inference_node.settings import HEADER_CHUNK, PARAMS_KEY, NodeSettings
from inferscale_kv.blob import CorruptKvBlob, decode_kv_blob
from inferscale_kv.rope import RotaryTables, apply_rope
from memory_service.kv_tiers import KvKey

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
HEADER_USER = "_profile"


@dataclass(frozen=True)
class ChunkLoad:
    """One chunk of the memory prefix: the header or a fact, at prompt positions [offset, offset + len)."""

    fact_id: str
    version: int
    offset: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadSpec:
    request_id: str
    profile_id: str
    user_id: str
    chunks: tuple[ChunkLoad, ...]
    start: int  # first prompt position to write (tokens before it are in vLLM's prefix cache)
    end: int  # one past the last position to write
    block_ids: tuple[int, ...]


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
            chunks.append(ChunkLoad(str(chunk["fact_id"]), int(chunk["version"]), offset, tuple(token_ids)))
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
        # Scheduler side: loads decided by update_state_after_alloc, not yet sent to the workers.
        self._pending: dict[str, LoadSpec] = {}
        # Worker side.
        self._model_config = vllm_config.model_config
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin in the model dtype on the device
        self._layers: dict[int, Any] | None = None
        self._cache = NodeKvCache(self.settings.node_cache_mb << 20)
        self._failed_blocks: set[int] = set()
        self._last_misses = 0
        self._phase_ends: dict[str, float] = {}
        self._stub = None
        self._stub_lock = threading.Lock()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        end, _ = provable_prefix(request.prompt_token_ids or [], request.kv_transfer_params, self.profile_id)
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            self._pending.pop(request.request_id, None)
            return
        end, chunks = provable_prefix(request.prompt_token_ids or [], request.kv_transfer_params, self.profile_id)
        plan = request.kv_transfer_params[PARAMS_KEY]
        self._pending[request.request_id] = LoadSpec(
            request_id=request.request_id, profile_id=self.profile_id, user_id=plan["user_id"],
            chunks=tuple(chunks), start=end - num_external_tokens, end=end, block_ids=(),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = InferScaleConnectorMetadata()
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
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, InferScaleConnectorMetadata):
            return
        for spec in metadata.loads:
            try:
                if self.settings.load_stats_path and torch.cuda.is_available():
                    torch.cuda.synchronize()  # benchmark mode: time this load's work alone
                started = time.perf_counter()
                self._load(spec, forward_context)
                if self.settings.load_stats_path:
                    self._record_load(spec, started)
            except Exception:  # noqa: BLE001 - never into the engine: report, and vLLM recomputes
                logger.exception("InferScale: KV load failed for request %s; it will be recomputed", spec.request_id)
                first, last = spec.start // self.block_size, (spec.end - 1) // self.block_size
                self._failed_blocks.update(spec.block_ids[first : last + 1])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------------ loading

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

    def _memory_stub(self):
        with self._stub_lock:
            if self._stub is None:
                import grpc

                from inferscale.v1 import memory_pb2_grpc

                channel = grpc.insecure_channel(self.settings.memory_service,
                                                options=[("grpc.max_receive_message_length", 256 << 20)])
                self._stub = memory_pb2_grpc.MemoryServiceStub(channel)
            return self._stub

    def _key(self, spec: LoadSpec, chunk: ChunkLoad) -> KvKey:
        if chunk.fact_id == HEADER_CHUNK:
            return KvKey(spec.profile_id, HEADER_USER, HEADER_CHUNK, 1)
        return KvKey(spec.profile_id, spec.user_id, chunk.fact_id, chunk.version)

    def _synthetic(self, chunk: ChunkLoad, device: torch.device, dtype: torch.dtype) -> CachedKv:
        config = self._model_config.hf_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, len(chunk.token_ids), config.num_key_value_heads, head_dim)
        return CachedKv(torch.randn(shape, device=device, dtype=dtype) * 0.1,
                        torch.randn(shape, device=device, dtype=dtype) * 0.1, chunk.token_ids)

    def _chunk_kv(self, spec: LoadSpec, device: torch.device, dtype: torch.dtype) -> list[CachedKv]:
        keys = [self._key(spec, chunk) for chunk in spec.chunks]
        entries = {key: self._cache.get(key) for key in keys}
        missing = [(key, chunk) for key, chunk in zip(keys, spec.chunks) if entries[key] is None]
        self._last_misses = len(missing)
        if missing and self.settings.synthetic_kv:
            for key, chunk in missing:
                entries[key] = self._synthetic(chunk, device, dtype)
                self._cache.put(key, entries[key], protected=set(keys))
        elif missing:
            from inferscale.v1 import memory_pb2 as pb

            request = pb.FetchKvRequest(
                profile_id=spec.profile_id, user_id=spec.user_id,
                include_header=any(chunk.fact_id == HEADER_CHUNK for _, chunk in missing),
                facts=[pb.FactRef(fact_id=c.fact_id, version=c.version) for _, c in missing
                       if c.fact_id != HEADER_CHUNK])
            replies = list(self._memory_stub().FetchKv(request, timeout=self.settings.fetch_timeout_s))
            for (key, chunk), reply in zip(missing, replies):
                if not reply.blob:
                    raise LookupError(f"memory service has no KV for {key}")
                kv = decode_kv_blob(reply.blob, dtype)
                if kv.header.token_ids != chunk.token_ids:
                    raise CorruptKvBlob(f"{key}: stored token ids differ from the prompt's")
                entry = CachedKv(kv.keys.to(device), kv.values.to(device), kv.header.token_ids)
                self._cache.put(key, entry, protected=set(keys))
                entries[key] = entry
        return [entries[key] for key in keys]

    def _attention_layers(self, forward_context: ForwardContext) -> dict[int, Any]:
        if self._layers is None:
            layers = {}
            for name, layer in forward_context.no_compile_layers.items():
                match = _LAYER_INDEX.search(name)
                if match and hasattr(layer, "impl") and hasattr(layer, "kv_cache"):
                    layers[int(match.group(1))] = layer
            if not layers:
                raise RuntimeError("no attention layers in the forward context")
            self._layers = layers
        return self._layers

    def _load(self, spec: LoadSpec, forward_context: ForwardContext) -> None:
        layers = self._attention_layers(forward_context)
        sample_cache = _layer_cache(next(iter(layers.values())), forward_context)
        device, dtype = sample_cache.device, self._model_config.dtype
        entries = self._chunk_kv(spec, device, dtype)
        self._mark("stage")

        key_parts, value_parts = [], []
        for chunk, entry in zip(spec.chunks, entries):
            lo, hi = max(spec.start, chunk.offset), min(spec.end, chunk.offset + len(chunk.token_ids))
            if lo == chunk.offset and hi == chunk.offset + len(chunk.token_ids):
                key_parts.append(entry.keys)
                value_parts.append(entry.values)
            elif lo < hi:
                key_parts.append(entry.keys[:, lo - chunk.offset : hi - chunk.offset])
                value_parts.append(entry.values[:, lo - chunk.offset : hi - chunk.offset])
        keys_pre = torch.cat(key_parts, dim=1)
        values = torch.cat(value_parts, dim=1)
        count = spec.end - spec.start
        if keys_pre.shape[1] != count or keys_pre.shape[0] < len(layers):
            raise ValueError(f"KV covers {tuple(keys_pre.shape)}, the load needs {count} tokens x {len(layers)} layers")
        if self._rope is None:
            tables = RotaryTables.from_config(self._model_config.hf_config, self._model_config.max_model_len, device)
            self._rope = (tables.cos.to(dtype), tables.sin.to(dtype))
        keys = apply_rope(keys_pre, spec.start, *self._rope)
        positions = torch.arange(spec.start, spec.end, device=device)
        block_table = torch.tensor(spec.block_ids, dtype=torch.int64).to(device, non_blocking=True)
        slots = block_table[positions // self.block_size] * self.block_size + positions % self.block_size
        self._mark("compose")
        for index, layer in layers.items():
            layer_keys, layer_values = keys[index], values[index]
            expected = (count, layer.num_kv_heads, layer.head_size)
            if tuple(layer_keys.shape) != expected:
                raise ValueError(f"layer {index}: KV shape {tuple(layer_keys.shape)} != {expected}")
            layer.impl.do_kv_cache_update(layer, layer_keys, layer_values, _layer_cache(layer, forward_context),
                                          slots)
        self._mark("write")


def _layer_cache(layer: Any, forward_context: Any) -> torch.Tensor:
    cache = layer.kv_cache
    if isinstance(cache, (list, tuple)):
        cache = cache[getattr(forward_context, "virtual_engine", 0)]
    return cache


def _with_blocks(spec: LoadSpec, block_ids: list[int]) -> LoadSpec:
    return LoadSpec(spec.request_id, spec.profile_id, spec.user_id, spec.chunks, spec.start, spec.end,
                    tuple(block_ids))
