"""InferScale's vLLM KV connector (v1 API): loads the memory prefix (header + facts) of a request from
precomputed, pre-RoPE fact KV instead of prefilling it.

vLLM loads `InferScaleConnector` from this package (`kv_connector_module_path: inference_node.connector`). It is a
thin façade, as vLLM's own NIXL connector is: in the scheduler process it holds an `InferScaleScheduler`
(scheduler.py), in each worker an `InferScaleWorker` (worker.py). The two roles share no state; they talk only
through the typed metadata (metadata.py: scheduler to workers once per step, and the workers' prefetch reports back
through vLLM's `KVConnectorOutput`, with the blocks of failed loads); their counters travel as `LoadStats`
(stats.py). The rest of the package serves the roles: the node cache (node_cache.py), residency in it and where
missing KV comes from (residency.py, kv_source.py), composition into the paged cache (compose.py), tensor-parallel
head shards (tensor_parallel.py) and benchmark load timing (load_timer.py). The load plan the scheduler verifies is
the middleware's (inference_node.plan).

Contract of the hooks, as InferScale implements them (scheduler.py's docstring lists every way a load could fail
and what closes it):
- `get_num_new_matched_tokens` (scheduler): claims only what a *signed* plan proves against the prompt's own token
  ids (inference_node.plan), and only once every chunk of it is resident in the node cache: then the load is
  synchronous (never async). Otherwise it answers None (vLLM skips the request this step and asks again) and
  orders the missing chunks prefetched, or, if a prefetch failed, timed out or cannot fit, claims nothing from then
  on (vLLM prefills the prompt). Idempotent: its only effects are the request's holds on its chunks and the
  prefetch of chunks nobody fetches yet, ordered once.
- `update_state_after_alloc` / `build_connector_meta` (scheduler): a load is sent to the workers exactly once per
  admission, in the step that schedules the request (also when a preempted request resumes, with its new block
  ids), together with the step's evictions (applied first) and prefetches (started last).
- `update_connector_output` (scheduler): the workers' prefetch reports (`build_connector_worker_meta`, summed over
  ranks) settle chunks: resident once every rank fetched them. Failed blocks of a load are a defect: its chunks are
  no longer trusted.
- `start_load_kv` / `build_connector_worker_meta` (worker): never raise into the engine and never wait on the
  network (prefetches run on fetch threads; the engine thread polls them). A load that fails anyway reports its
  blocks through `get_block_ids_with_load_errors`, and with kv_load_failure_policy="fail" vLLM fails that request
  with an error instead of recomputing it.
- `request_finished` (scheduler): drops the request's state and holds; never delays freeing blocks; returns what
  became of the request's memory (loaded, waited, partial, prefix cache, prefilled), which vLLM puts in the
  response's `kv_transfer_params` and the middleware in `x-inferscale-memory`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from inference_node.connector.metadata import InferScaleConnectorMetadata
from inference_node.connector.scheduler import InferScaleScheduler
from inference_node.connector.stats import ConnectorPromMetrics, LoadStats
from inference_node.connector.worker import InferScaleWorker
from inference_node.settings import NodeSettings
from inferscale_kv.rope import check_rotary_supported

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["InferScaleConnector", "check_supported"]


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> None:
    """Refuses, at engine start, configurations under which injected KV would be wrong or a failed load fatal."""
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("InferScaleConnector: pipeline parallelism is not supported (use tensor parallelism)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError("InferScaleConnector: speculative decoding is not supported (a draft model's attention "
                         "layers would get no memory KV)")
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)
    if policy != "fail":
        raise ValueError(f"InferScaleConnector: needs kv_load_failure_policy='fail', got {policy!r} (every load is "
                         "synchronous; a load that still fails must fail its request, and vLLM's recompute of a "
                         "failed synchronous load can answer wrong tokens: upstream issue 49250)")
    check_rotary_supported(vllm_config.model_config.hf_config)
    if kv_cache_config is not None:
        specs = [type(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]
        if specs != [FullAttentionSpec]:
            raise ValueError("InferScaleConnector: needs one KV cache group of full attention, got "
                             f"{[spec.__name__ for spec in specs]} (sliding-window or hybrid models are not supported)")


class InferScaleConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = NodeSettings.from_mapping((transfer.kv_connector_extra_config if transfer else None) or {})
        self._scheduler: InferScaleScheduler | None = None
        self._worker: InferScaleWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = InferScaleScheduler(vllm_config, settings)
        else:
            self._worker = InferScaleWorker.from_settings(vllm_config, settings)

    @property
    def _scheduler_role(self) -> InferScaleScheduler:
        if self._scheduler is None:
            raise RuntimeError("InferScaleConnector: a scheduler hook was called on a worker")
        return self._scheduler

    @property
    def _worker_role(self) -> InferScaleWorker:
        if self._worker is None:
            raise RuntimeError("InferScaleConnector: a worker hook was called on the scheduler")
        return self._worker

    # ------------------------------------------------------------------ scheduler role

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_role.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_role.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_role.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_role.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler_role.request_finished(request)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LoadStats | None:
        return LoadStats(data=dict(data)) if data is not None else LoadStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ConnectorPromMetrics:
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> LoadStats | None:
        return self._scheduler.take_stats() if self._scheduler is not None else self._worker_role.take_stats()

    # ------------------------------------------------------------------ worker role

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if isinstance(metadata, InferScaleConnectorMetadata):
            self._worker_role.start_load_kv(metadata, forward_context)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_role.build_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_role.take_failed_blocks()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
