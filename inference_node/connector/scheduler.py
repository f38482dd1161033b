"""The connector's scheduler role: which prompt prefix a request's signed plan proves, whether its load can run
synchronously (every chunk resident in the node cache) or must wait for a fetch, and what the node cache holds.

Runs in vLLM's EngineCore process on the scheduler's thread; nothing here touches the network or the device.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from inference_node.connector.metadata import InferScaleConnectorMetadata, LoadSpec
from inference_node.connector.node_cache import NodeCacheDirectory
from inference_node.connector.stats import LoadStats
from inference_node.connector.tensor_parallel import KvHeadShard
from inference_node.plan import NO_PREFIX, ChunkLoad, PlanSigner, ProvenPrefix, plan_secret_from_env, provable_prefix
from inference_node.settings import NodeSettings
from inferscale_kv.shape import KvShape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
# Synchronous loads are remembered this long (in loads) so that a failure reported a step later finds them.
_RECENT_SYNC_LOADS = 512


class InferScaleScheduler:
    def __init__(self, vllm_config: VllmConfig, settings: NodeSettings) -> None:
        self.profile_id = settings.profile_id
        self._synchronous_loads = settings.synchronous_loads
        self._signer = PlanSigner(plan_secret_from_env())
        tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
        self._directory = NodeCacheDirectory(settings.node_cache_mb << 20,
                                             _bytes_per_token_per_rank(vllm_config.model_config, tensor_parallel_size))
        self._proofs: dict[str, ProvenPrefix] = {}  # request id -> what its plan proves of its prompt
        self._computed: dict[str, int] = {}  # request id -> vLLM's local hit at its last matching query
        self._pending: dict[str, LoadSpec] = {}  # decided by update_state_after_alloc, not yet sent
        self._inflight: dict[str, LoadSpec] = {}  # async loads sent, not yet reported finished
        self._failed_inflight: set[str] = set()  # of those, the ones some rank reported failed blocks for
        self._recent_sync: OrderedDict[str, LoadSpec] = OrderedDict()
        self._stats = LoadStats()

    def _proof(self, request: Request) -> ProvenPrefix:
        """The prefix the request's plan proves (memoized per request: its prompt and plan never change)."""
        memo = self._proofs.get(request.request_id)
        if memo is not None:
            return memo
        proof = NO_PREFIX
        if request.kv_transfer_params:
            plan = self._signer.verified(request.kv_transfer_params)
            if plan is None or request.cache_salt != self._signer.cache_salt(plan):
                self._refuse(request, "unsigned, altered or malformed plan, or a salt the plan does not sign")
            elif getattr(request, "lora_request", None) is not None:
                self._refuse(request, "LoRA request (fact KV is the base model's)")
            else:
                proof = provable_prefix(request.prompt_token_ids or [], plan, self.profile_id)
        self._proofs[request.request_id] = proof
        return proof

    def _refuse(self, request: Request, why: str) -> None:
        self._stats.add("plans_refused")
        logger.warning("InferScale: request %s: load plan refused (%s); its prompt is prefilled",
                       request.request_id, why)

    def _loads_async(self, chunks: tuple[ChunkLoad, ...]) -> bool:
        """Synchronous only where allowed and every chunk is resident: it never fetches, so it cannot wait."""
        return not (self._synchronous_loads and all(self._directory.is_resident(chunk.key) for chunk in chunks))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        proof = self._proof(request)
        self._computed[request.request_id] = num_computed_tokens  # where a load allocated next would start
        claim = max(0, proof.end - num_computed_tokens)
        return claim, claim > 0 and self._loads_async(proof.chunks_from(num_computed_tokens))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decides the load vLLM just allocated for: positions [local hit, local hit + external tokens), into the
        request's block ids as allocated here (final for this admission, also when a preempted request resumes)."""
        computed = self._computed.pop(request.request_id, None)
        if num_external_tokens <= 0:
            self._pending.pop(request.request_id, None)
            return
        proof = self._proof(request)
        start = computed if computed is not None else proof.end - num_external_tokens
        chunks = proof.chunks_from(start)  # those before `start` are in vLLM's prefix cache: not staged, not needed
        self._pending[request.request_id] = LoadSpec(request.request_id, proof.user_id, chunks, start,
                                                     start + num_external_tokens, tuple(blocks.get_block_ids()[0]),
                                                     self._loads_async(chunks))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> InferScaleConnectorMetadata:
        """Sends every load decided since the last step: a synchronous one's request is scheduled in this step (vLLM
        allocates and schedules it together), an async one's waits for it."""
        metadata = InferScaleConnectorMetadata(loads=list(self._pending.values()))
        self._pending.clear()
        protected = {chunk.key for spec in metadata.loads for chunk in spec.chunks}
        for spec in metadata.loads:
            if spec.load_async:
                self._inflight[spec.request_id] = spec
                self._directory.start_fetch(((c.key, len(c.token_ids)) for c in spec.chunks), protected)
            else:
                self._directory.touch(chunk.key for chunk in spec.chunks)
                self._recent_sync[spec.request_id] = spec
                while len(self._recent_sync) > _RECENT_SYNC_LOADS:
                    self._recent_sync.popitem(last=False)
        metadata.evictions = tuple(self._directory.take_evictions())
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Settles async loads (resident only when finished without failed blocks) and stops trusting the chunks
        of failed synchronous loads."""
        invalid = set(connector_output.invalid_block_ids or ())
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        # Under tensor parallelism a rank's failed blocks arrive in the step that rank reports them, the request
        # as finished only once every rank did: a failure seen earlier is remembered until the finish.
        self._failed_inflight.update(req_id for req_id, spec in self._inflight.items()
                                     if not invalid.isdisjoint(spec.block_ids))
        for req_id in {*(connector_output.finished_recving or ()), *failed}:
            spec = self._inflight.pop(req_id, None)
            if spec is not None:
                loaded = req_id not in failed and req_id not in self._failed_inflight
                self._failed_inflight.discard(req_id)
                self._directory.settle([chunk.key for chunk in spec.chunks], loaded)
                if not loaded and req_id in self._proofs:
                    self._proofs[req_id] = NO_PREFIX  # vLLM prefills it; a re-admitted request claims nothing
        if invalid:
            for req_id, spec in list(self._recent_sync.items()):
                if not invalid.isdisjoint(spec.block_ids):
                    self._directory.drop(chunk.key for chunk in spec.chunks)
                    if req_id in self._proofs:
                        self._proofs[req_id] = NO_PREFIX
                    del self._recent_sync[req_id]

    def request_finished(self, request: Request) -> None:
        # An async load in flight stays in _inflight: vLLM frees the blocks only once it is reported finished.
        self._pending.pop(request.request_id, None)
        self._proofs.pop(request.request_id, None)
        self._computed.pop(request.request_id, None)
        self._recent_sync.pop(request.request_id, None)

    def take_stats(self) -> LoadStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, LoadStats()
        return stats


def _bytes_per_token_per_rank(model_config: Any, tensor_parallel_size: int) -> int:
    """KV bytes of one token in one rank's node cache (every rank holds the same number of heads)."""
    rank_shape = KvHeadShard(0, tensor_parallel_size).of(KvShape.from_config(model_config.hf_config))
    return rank_shape.elements_per_token() * model_config.dtype.itemsize
