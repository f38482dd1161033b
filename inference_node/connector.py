"""InferScale's vLLM KV connector (v1 API): loads the memory prefix (header + facts) of a request from
precomputed, pre-RoPE fact KV instead of prefilling it.

`InferScaleConnector` is a thin façade, as vLLM's own NIXL connector is: in the scheduler process it holds an
`InferScaleScheduler` (connector_scheduler.py), in each worker an `InferScaleWorker` (connector_worker.py). The two
roles share no state; they talk only through the typed metadata below (scheduler to workers, once per step) and
vLLM's `KVConnectorOutput` (workers to scheduler: finished and failed loads).

Contract of the hooks, as InferScale implements them:
- `get_num_new_matched_tokens` (scheduler): side-effect free apart from a per-request memo of the verified plan;
  the same answer for the same request within a step. It claims only what a *signed* plan proves against the
  prompt's own token ids (inference_node.plan), and says "async" unless every chunk is resident in the node cache
  and synchronous loads are allowed (NodeSettings.synchronous_loads: off on CUDA, where vLLM 0.26 recomputes a
  refused synchronous load wrongly; an async load of resident chunks is written in the same step it is sent).
- `update_state_after_alloc` / `build_connector_meta` (scheduler): a load is sent to the workers exactly once,
  also when a preempted request resumes (then with all of its new block ids); the node-cache evictions the
  directory decided travel in the same metadata and are applied before any load of the step.
- `update_connector_output` (scheduler): async loads settle here; a chunk becomes resident only when its load was
  reported finished without failed blocks.
- `start_load_kv` / `get_finished` (worker): never raise into the engine. A failed load is reported through
  `get_block_ids_with_load_errors` (for an async load no later than the step that reports it finished) and, with
  kv_load_failure_policy="recompute", vLLM prefills those tokens itself. A synchronous load never touches the
  network: a chunk missing from the node cache fails it at once.
- `request_finished` (scheduler): drops the request's memo and pending load; never delays freeing blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from inference_node.connector_stats import ConnectorPromMetrics, LoadStats
from inference_node.plan import ChunkLoad
from inferscale_kv.kv_key import KvKey
from inferscale_kv.rope import check_rotary_supported

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass(frozen=True)
class LoadSpec:
    request_id: str
    user_id: str
    chunks: tuple[ChunkLoad, ...]
    start: int  # first prompt position to write (tokens before it are in vLLM's prefix cache)
    end: int  # one past the last position to write
    block_ids: tuple[int, ...]
    load_async: bool = False


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    evictions: tuple[KvKey, ...] = ()  # node-cache entries to drop before this step's loads


def check_supported(vllm_config: VllmConfig, kv_cache_config: Any = None) -> None:
    """Refuses, at engine start, configurations under which injected KV would be wrong or a failed load fatal."""
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("InferScaleConnector: pipeline parallelism is not supported (use tensor parallelism)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError("InferScaleConnector: speculative decoding is not supported (a draft model's attention "
                         "layers would get no memory KV)")
    check_rotary_supported(vllm_config.model_config.hf_config)
    if kv_cache_config is not None:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        specs = [type(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]
        if specs != [FullAttentionSpec]:
            raise ValueError("InferScaleConnector: needs one KV cache group of full attention, got "
                             f"{[spec.__name__ for spec in specs]} (sliding-window or hybrid models are not supported)")


class InferScaleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        from inference_node.settings import NodeSettings

        settings = NodeSettings.from_mapping(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        # Imported here: each role module imports this one's metadata types.
        from inference_node.connector_scheduler import InferScaleScheduler
        from inference_node.connector_worker import InferScaleWorker

        self._scheduler: InferScaleScheduler | None = None
        self._worker: InferScaleWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = InferScaleScheduler(vllm_config, settings)
        else:
            self._worker = InferScaleWorker(vllm_config, settings)

    # ------------------------------------------------------------------ scheduler role

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._scheduler.request_finished(request)
        return False, None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LoadStats | None:
        return LoadStats(data=dict(data)) if data is not None else LoadStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ConnectorPromMetrics:
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> LoadStats | None:
        return (self._scheduler or self._worker).take_stats()

    # ------------------------------------------------------------------ worker role

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, InferScaleConnectorMetadata):
            self._worker.start_load_kv(metadata, forward_context)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
