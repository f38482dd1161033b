"""The connector's scheduler role: which prompt prefix a request's signed plan proves, and when to load it.

Every load is synchronous (written before the forward of the step that admits the request) and declared only when
it is proven to succeed: every chunk it reads is resident in every rank's node cache (node_cache.NodeCacheDirectory)
and stays there until the load has been sent. A request whose chunks are not all resident is answered "not yet"
(`None`: vLLM skips it this step, allocates nothing and asks again next step) while the step's metadata orders the
missing chunks prefetched; the workers fetch them on their fetch threads and report each settled chunk back through
vLLM's worker-to-scheduler channel (metadata.PrefetchReport), so the request is admitted, with its load, in the
first step after they are resident. Whether a request waits at all is the miss policy's call (miss_policy.py): where
bringing its missing bytes is slower than prefilling what they stand for, the request loads at once the resident
prefix of its memory and vLLM prefills the rest, while the missing chunks are fetched in the background for the
user's next request. A prefetch that fails or times out means the request claims nothing and vLLM prefills its
prompt; one that does not fit the device tier leaves it its resident prefix: no vLLM failure path is involved.
The connector starts only under
kv_load_failure_policy="fail", so a synchronous load that still fails in a worker (a defect) fails that one request
with an error and never reaches vLLM's recompute of refused synchronous loads (wrong on vLLM 0.26: upstream issue
49250, benchmarks/RESULTS.md, "Refused loads on the GPU").

Every way a synchronous load could be refused or diverge, and what closes it here:
1. A chunk missing from a rank's node cache (never fetched, evicted, or fetched by some ranks only): a load is
   declared only when the directory holds every chunk resident; a chunk is resident only once every rank reported
   it fetched; workers never evict on their own, only by the directory's evictions.
2. A chunk evicted in the same step, or between the answer and the allocation: from the first answer that names a
   chunk until its load is sent (or the request falls back or finishes) the request holds it, and held chunks are
   never evicted; workers apply a step's evictions before its loads, so no load reads a chunk evicted after it.
3. Token ids that differ: the plan is proven against the prompt's own token ids (plan.provable_prefix); the
   directory knows a key with one token-id tuple, which the fetch checked against the blob; a request naming a
   known key with other token ids claims nothing; every worker lookup checks them again.
4. Slice bounds: the load spans vLLM's local hit to the proven end and reads the chunks covering it; a prefetched
   entry is checked against the rank's KV shape and the model dtype before it counts as fetched, and every slice is
   bounds-checked before a kernel reads it.
5. A chunk partly in vLLM's prefix cache: the load starts at the local hit, mid-chunk if need be; only the chunks
   holding positions at or after it must be resident.
6. Preemption and resume: vLLM asks again for a resumed request; the decision is taken anew (its chunks may have
   left: then it waits for a prefetch again) and the load goes to its new blocks.
7. A full-prompt hit, which vLLM cannot take (it must compute one token: upstream issue 55113): the proven prefix
   stops before the last prompt token, so local hit + claim < prompt length.
8. A tensor-parallel rank that disagrees: resident needs every rank's report; a chunk any rank failed is evicted
   from all; each rank holds and checks its own head shard.
9. A prefetch that fails, or is not settled within fetch_timeout_s + PREFETCH_GRACE_S: the requests waiting for it
   claim nothing and are prefilled by vLLM; a rank that could not start it within that time reports it failed
   without fetching, so a backlog of fetches nobody waits for does not make later requests wait.
10. A prefetch racing an eviction: a chunk being fetched cannot be evicted; a failed one is evicted only once every
   rank settled it, and a later prefetch of it travels in the same or a later step, after the eviction.
11. No room: a prefetch that cannot fit the budget after evicting every unheld chunk is not ordered; the request
   claims its resident prefix only.
12. Requests sharing chunks: a chunk is prefetched once; every request needing it waits for that fetch and holds it.
13. A request aborted while its prefetch runs: its holds go; the prefetch settles on its own.
14. What remains is a defect (a device error, an exception in the worker's write): vLLM fails that request
   (FINISHED_ERROR) and the engine serves on; counted (load_defects), logged, and its chunks are no longer trusted
   (the next request fetches them again).
15. A request vLLM computes in full (it skips the prefix cache, or asks for prompt logprobs): vLLM would discard
   the claim, so it claims nothing, holds nothing and orders no prefetch.
16. A partial load (the miss policy's or for lack of room): it claims the chunks before the first one not
   resident, which it holds like any load's; the rest of the prompt is vLLM's to prefill, and the chunks it did not
   claim are fetched without anyone waiting for them.
17. A warm-up (the plan's signed list of the user's next facts): fetched into the host tier only, into its free
   room, never loaded on its account; a later request loads such a chunk only where its own plan names it, after a
   host-to-device copy that settles like any prefetch.

Runs in vLLM's EngineCore process on the scheduler's thread; nothing here touches the network or the device.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from inference_node.connector.metadata import InferScaleConnectorMetadata, LoadSpec, PrefetchReport
from inference_node.connector.miss_policy import MissPolicy
from inference_node.connector.node_cache import NodeCacheDirectory
from inference_node.connector.stats import LoadStats
from inference_node.connector.tensor_parallel import KvHeadShard
from inference_node.plan import (
    LOAD_OUTCOME_KEY,
    NO_PREFIX,
    ChunkLoad,
    LoadPlan,
    PlanSigner,
    ProvenPrefix,
    plan_secret_from_env,
    provable_prefix,
    user_token_of,
    warm_up_chunks,
)
from inference_node.settings import NodeSettings
from inferscale_kv.kv_key import KvKey
from inferscale_kv.shape import KvShape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)
# Beyond the fetch's own deadline: the worker's decode and device copy, and its turn on the fetch threads.
PREFETCH_GRACE_S = 2.0
# Sent loads are remembered this many steps, so that failed blocks reported later find their load.
_RECENT_STEPS = 8
# Steps built ahead of their output: vLLM's async scheduling builds one step ahead (kept bounded all the same).
_STEPS_AHEAD = 2
# A chunk whose fetch failed is not fetched again in the background (for nobody waiting) within this long.
BACKGROUND_RETRY_S = 30.0


# What became of a request's memory (request_finished's answer, which vLLM puts in the response's
# kv_transfer_params and the middleware in x-inferscale-memory): loaded from the device tier at once (resident), after
# waiting for its chunks (waited), its resident prefix only with the rest prefilled (partial), nothing to load because
# vLLM's prefix cache held it (prefix_cache), or prefilled after a failed or refused load (prefilled).
RESIDENT, WAITED, PARTIAL, PREFIX_CACHE, PREFILLED = "resident", "waited", "partial", "prefix_cache", "prefilled"


@dataclass(frozen=True)
class LoadOutcome:
    how: str
    tokens_loaded: int = 0


@dataclass
class _Admission:
    """A request being decided: the chunks it holds, and the prefetch it waits for of each chunk that was not
    resident when it needed it (the prefetch's id)."""

    held: set[KvKey] = field(default_factory=set)
    waited: dict[KvKey, int] = field(default_factory=dict)
    looked_up: bool = False  # its chunks were counted in the node-cache lookups


def _reads_no_cached_kv(request: Request) -> bool:
    """vLLM computes every prompt token of this request (it skips the prefix cache, or asks for prompt logprobs):
    a load would be discarded (vLLM overrides the answer with 0) or leave positions without their logprobs, and
    ordering its prefetch would only evict others' chunks."""
    if getattr(request, "skip_reading_prefix_cache", False):
        return True
    sampling = getattr(request, "sampling_params", None)
    return sampling is not None and getattr(sampling, "prompt_logprobs", None) is not None


class InferScaleScheduler:
    def __init__(self, vllm_config: VllmConfig, settings: NodeSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.profile_id = settings.profile_id
        self._signer = PlanSigner(plan_secret_from_env())
        self._clock = clock
        self._fetch_wait_s = settings.fetch_timeout_s + PREFETCH_GRACE_S
        tensor_parallel_size = vllm_config.parallel_config.tensor_parallel_size
        on_cuda = vllm_config.device_config.device_type == "cuda"
        self._directory = NodeCacheDirectory(settings.node_cache_mb << 20,
                                             _bytes_per_token_per_rank(vllm_config.model_config, tensor_parallel_size),
                                             tensor_parallel_size, (settings.host_tier_mb or 0) << 20,
                                             host_pinned=on_cuda)
        self._miss_policy = MissPolicy(settings.kv_miss_policy, on_cuda)
        self._partial: set[str] = set()  # requests the policy (or the lack of room) serves with their resident prefix
        self._outcomes: dict[str, LoadOutcome] = {}  # what became of each request's memory so far
        # Steps built and not yet output, oldest first (when built, tokens scheduled), and when the last output came:
        # a step's forward runs from the later of its build and the previous step's output (vLLM's async scheduling
        # builds step N+1 before step N's output), to its own output.
        self._steps: deque[tuple[float, int]] = deque(maxlen=_STEPS_AHEAD)
        self._last_output: float | None = None
        self._proofs: dict[str, ProvenPrefix] = {}  # request id -> what its plan proves of its prompt
        self._computed: dict[str, int] = {}  # request id -> vLLM's local hit at its last answer
        self._admissions: dict[str, _Admission] = {}
        self._pending: dict[str, LoadSpec] = {}  # decided by update_state_after_alloc, not yet sent
        self._recent: deque[list[LoadSpec]] = deque(maxlen=_RECENT_STEPS)
        self._stats = LoadStats()

    def _proof(self, request: Request) -> ProvenPrefix:
        """The prefix the request's plan proves (memoized per request: its prompt and plan never change)."""
        memo = self._proofs.get(request.request_id)
        if memo is not None:
            return memo
        proof = NO_PREFIX
        if request.kv_transfer_params:
            verified = self._signer.verified_with_salt(request.kv_transfer_params)
            if verified is None or request.cache_salt != verified[1]:
                self._refuse(request, "unsigned, altered or malformed plan, or a salt the plan does not sign")
            elif getattr(request, "lora_request", None) is not None:
                self._refuse(request, "LoRA request (fact KV is the base model's)")
            else:
                user_token = user_token_of(request.kv_transfer_params)
                proof = provable_prefix(request.prompt_token_ids or [], verified[0], self.profile_id, user_token)
                self._warm_up(request, verified[0], user_token)
        self._proofs[request.request_id] = proof
        return proof

    def _warm_up(self, request: Request, plan: LoadPlan, user_token: str) -> None:
        """Orders the plan's signed warm-up (the user's next facts) into the host tier: once per request, into its
        free room only, on a fetch thread of its own (never in front of a request's fetch)."""
        chunks = warm_up_chunks(self._signer.verified_warm_up(request.kv_transfer_params), plan, self.profile_id)
        if chunks:
            self._stats.add("warmed_chunks", self._directory.warm(plan.user_id, chunks, self._clock(),
                                                                  self._fetch_wait_s, user_token))

    def _refuse(self, request: Request, why: str) -> None:
        self._stats.add("plans_refused")
        self._outcomes[request.request_id] = LoadOutcome(PREFILLED)
        logger.warning("InferScale: request %s: load plan refused (%s); its prompt is prefilled",
                       request.request_id, why)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tokens a synchronous load will supply beyond vLLM's local hit, or None while the request waits for
        its chunks to be prefetched. Never async. Its only effects are idempotent: the request's holds, the prefetch
        of chunks nobody fetches yet (ordered once), and the copy back of host-tier chunks (ordered once: they are
        resident from then on), whether or not vLLM then schedules the request."""
        if _reads_no_cached_kv(request):
            self._forget(request.request_id)
            return 0, False
        proof = self._proof(request)
        self._computed[request.request_id] = num_computed_tokens  # where a load allocated next would start
        if proof.end <= num_computed_tokens:
            if proof is not NO_PREFIX:
                self._outcomes.setdefault(request.request_id, LoadOutcome(PREFIX_CACHE))
            self._forget(request.request_id)
            return 0, False
        chunks = proof.chunks_from(num_computed_tokens)
        end = self._loadable_end(request.request_id, proof, chunks, num_computed_tokens)
        if isinstance(end, str):
            self._fall_back(request, end)
            return 0, False
        return (None, False) if end is None else (max(0, end - num_computed_tokens), False)

    def _loadable_end(self, request_id: str, proof: ProvenPrefix, chunks: tuple[ChunkLoad, ...],
                      num_computed: int) -> int | str | None:
        """Where the request's load ends: the proven end if every chunk is resident, or in the host tier and copied
        back in this step (it now holds them); None while it waits for prefetches (ordered here when nobody fetches
        them yet); the start of its first chunk not resident where the miss policy (or the lack of room) serves its
        resident prefix; or why it cannot load."""
        directory = self._directory
        if any(directory.knows_other_tokens(chunk) for chunk in chunks):
            return "a chunk's key is known with other token ids"
        admission = self._admissions.setdefault(request_id, _Admission())
        missing = [chunk for chunk in chunks if not directory.is_resident(chunk)]
        if not admission.looked_up:
            admission.looked_up = True
            self._stats.add("node_cache_lookups", len(chunks))
            self._stats.add("node_cache_hits", len(chunks) - len(missing))
        if not missing:
            self._hold(admission, chunks)
            return proof.end
        now = self._clock()
        if request_id not in self._partial:
            failed = self._waited_in_vain(admission, missing, now)
            if failed is not None:
                return failed
            # Bytes only the memory service has: the policy weighs them (and the host tier's copy) against their
            # prefill, once. Chunks all in the host tier are copied back in this step, before the load: nothing to
            # weigh.
            host_bytes, source_bytes = (0, 0) if admission.waited else directory.bytes_to_bring(missing)
            if source_bytes:
                prefilled = proof.end - max(min(chunk.offset for chunk in missing), num_computed)
                if not self._miss_policy.decide(host_bytes, source_bytes, prefilled).wait:
                    self._serve_partially(request_id)
        missing = self._promote(admission, chunks, missing, request_id in self._partial)
        if not missing:
            self._hold(admission, chunks)
            return proof.end
        first_missing = min(chunk.offset for chunk in missing)
        if request_id in self._partial:
            return self._resident_prefix(admission, proof, chunks, missing, first_missing)
        self._hold(admission, chunks)
        to_fetch = [chunk for chunk in missing if directory.fetch_id(chunk.key) is None]
        if to_fetch and not directory.prefetch(proof.user_id, to_fetch, now, self._fetch_wait_s, proof.user_token):
            self._serve_partially(request_id)  # no room to bring them: its resident prefix, at once
            return self._resident_prefix(admission, proof, chunks, missing, first_missing)
        admission.waited.update({chunk.key: fetch_id for chunk in missing
                                 if (fetch_id := directory.fetch_id(chunk.key)) is not None})
        return None

    def _waited_in_vain(self, admission: _Admission, missing: list[ChunkLoad], now: float) -> str | None:
        """Why the request cannot load, where a prefetch it waited for ended without making its chunk resident or
        a prefetch of one of its chunks outlived its deadline; else None."""
        for chunk in missing:
            fetch_id = self._directory.fetch_id(chunk.key)
            if chunk.key in admission.waited and fetch_id != admission.waited[chunk.key]:
                return "its prefetch failed"
            if fetch_id is not None and self._directory.fetch_expired(chunk.key, now):
                return "its prefetch did not finish in time"
        return None

    def _promote(self, admission: _Admission, chunks: tuple[ChunkLoad, ...], missing: list[ChunkLoad],
                 prefix_only: bool) -> list[ChunkLoad]:
        """Orders the missing chunks the host tier holds (and nobody fetches) copied into the device tier in this
        step, before its loads, where the device tier has room for them all (the request holds its chunks first, so
        none of its own makes that room); returns those still missing. With `prefix_only` (a partial load), only
        those before the first chunk that has to come from the memory service."""
        directory = self._directory
        promotable = []
        for chunk in sorted(missing, key=lambda chunk: chunk.offset):
            if directory.is_on_host(chunk) and directory.fetch_id(chunk.key) is None:
                promotable.append(chunk)
            elif prefix_only:
                break
        if not promotable:
            return missing
        self._hold(admission, chunks)
        if not directory.promote(promotable):
            return missing
        promoted = {chunk.key for chunk in promotable}
        return [chunk for chunk in missing if chunk.key not in promoted]

    def _hold(self, admission: _Admission, chunks: Sequence[ChunkLoad]) -> None:
        new_holds = {chunk.key for chunk in chunks} - admission.held
        self._directory.hold(new_holds)
        admission.held |= new_holds

    def _serve_partially(self, request_id: str) -> None:
        self._partial.add(request_id)
        self._stats.add("partial_loads")

    def _resident_prefix(self, admission: _Admission, proof: ProvenPrefix, chunks: tuple[ChunkLoad, ...],
                         missing: list[ChunkLoad], first_missing: int) -> int:
        """The end of the request's resident prefix (it holds the chunks before it, all resident), ordering the
        missing chunks nobody fetches yet brought in the background for the user's next request: into the host tier
        where the node keeps one (one copy away then, and no other user's device-tier chunk evicted for them; a GPU
        run with a device tier for two users found background fetches refused for room there, so the next request
        fetched them again), else into the device tier where they fit."""
        self._hold(admission, [chunk for chunk in chunks if chunk.offset < first_missing])
        now = self._clock()
        directory = self._directory
        to_fetch = [chunk for chunk in missing if directory.fetch_id(chunk.key) is None
                    and not directory.is_on_host(chunk)
                    and not directory.recently_failed(chunk.key, now, BACKGROUND_RETRY_S)]
        if to_fetch and directory.host_budget_bytes:
            self._stats.add("warmed_chunks", directory.warm(proof.user_id, to_fetch, now, self._fetch_wait_s,
                                                            proof.user_token))
        elif to_fetch:
            directory.prefetch(proof.user_id, to_fetch, now, self._fetch_wait_s, proof.user_token)
        return min(proof.end, first_missing)

    def _fall_back(self, request: Request, why: str) -> None:
        """The request claims nothing from now on (also when resumed): vLLM prefills its prompt."""
        self._stats.add("load_failures")
        logger.warning("InferScale: request %s: memory not loaded (%s); its prompt is prefilled",
                       request.request_id, why)
        self._outcomes[request.request_id] = LoadOutcome(PREFILLED)
        self._proofs[request.request_id] = NO_PREFIX
        self._forget(request.request_id)

    def _forget(self, request_id: str) -> None:
        """Releases the request's holds."""
        admission = self._admissions.pop(request_id, None)
        if admission is not None:
            self._directory.release(admission.held)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Decides the load vLLM just allocated for: positions [local hit, local hit + external tokens), into the
        request's block ids as allocated here (final for this admission, also when a preempted request resumes)."""
        computed = self._computed.pop(request.request_id, None)
        if num_external_tokens <= 0:
            self._pending.pop(request.request_id, None)
            self._forget(request.request_id)
            return
        proof = self._proof(request)
        if computed is None:
            # vLLM allocated external tokens it was never answered: it counts them computed, so blocks left as they
            # are would be read as someone's KV. A load of no chunks fails in the worker, and vLLM fails the request.
            logger.error("InferScale defect: request %s was allocated %d external tokens it was never answered; "
                         "the request is failed", request.request_id, num_external_tokens)
            self._forget(request.request_id)
            self._pending[request.request_id] = LoadSpec(
                request.request_id, proof.user_id, (), proof.end - num_external_tokens, proof.end,
                tuple(blocks.get_block_ids()[0]))
            return
        start = computed
        end = start + num_external_tokens
        # Those before `start` are in vLLM's prefix cache, those from `end` on (a partial load) vLLM prefills.
        chunks = tuple(chunk for chunk in proof.chunks_from(start) if chunk.offset < end)
        self._pending[request.request_id] = LoadSpec(request.request_id, proof.user_id, chunks, start, end,
                                                     tuple(blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> InferScaleConnectorMetadata:
        """This step's evictions, the loads decided in it (each request is scheduled in this same step) and the
        prefetches ordered in it. A sent load's holds are released: a later eviction reaches the workers after it."""
        loads = list(self._pending.values())
        self._pending.clear()
        for spec in loads:
            self._directory.touch(chunk.key for chunk in spec.chunks)
            admission = self._admissions.get(spec.request_id)
            waited = admission is not None and bool(admission.waited)
            if waited:
                self._stats.add("async_loads")
            how = PARTIAL if spec.request_id in self._partial else WAITED if waited else RESIDENT
            loaded = self._outcomes.get(spec.request_id)
            self._outcomes[spec.request_id] = LoadOutcome(
                how, spec.end - spec.start + (loaded.tokens_loaded if loaded is not None else 0))
            self._forget(spec.request_id)
        self._recent.append(loads)
        tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
        if tokens:  # a step of no tokens runs no forward, and its output reaches no connector
            self._steps.append((self._clock(), tokens))
        return InferScaleConnectorMetadata(evictions=self._directory.take_evictions(),
                                           promotions=self._directory.take_promotions(),
                                           host_evictions=self._directory.take_host_evictions(), loads=loads,
                                           prefetches=self._directory.take_prefetches())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Settles the prefetches the workers report, and stops trusting the chunks of a load some worker failed
        (a defect: vLLM fails that request under kv_load_failure_policy="fail")."""
        now = self._clock()
        if self._steps:
            built, tokens = self._steps.popleft()
            started = built if self._last_output is None else max(built, self._last_output)
            self._miss_policy.observe_step(tokens, now - started)
        self._last_output = now
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, PrefetchReport):
            self._directory.settle(report)
            self._miss_policy.observe_transfers(report.transfer_bytes, report.transfer_micros)
        invalid = set(connector_output.invalid_block_ids or ())
        for loads in reversed(self._recent):  # a block's newest load is the one that failed (blocks get reused)
            for spec in [spec for spec in loads if not invalid.isdisjoint(spec.block_ids)]:
                invalid.difference_update(spec.block_ids)
                loads.remove(spec)
                self._stats.add("load_defects")
                logger.error("InferScale defect: the synchronous load of request %s failed in a worker; vLLM fails "
                             "the request (kv_load_failure_policy=fail). Its chunks are fetched again when next "
                             "needed.", spec.request_id)
                self._directory.drop(chunk.key for chunk in spec.chunks)

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Drops the request's state and holds (a prefetch it started settles on its own); returns what became of
        its memory, for the response's kv_transfer_params ({LOAD_OUTCOME_KEY: {"outcome": ..., "tokens_loaded": n}}),
        or None for a request without a plan."""
        outcome = self._outcomes.pop(request.request_id, None)
        if outcome is None and request.request_id in self._partial:
            outcome = LoadOutcome(PARTIAL)
        self._pending.pop(request.request_id, None)
        self._proofs.pop(request.request_id, None)
        self._computed.pop(request.request_id, None)
        self._partial.discard(request.request_id)
        self._forget(request.request_id)
        return {LOAD_OUTCOME_KEY: {"outcome": outcome.how, "tokens_loaded": outcome.tokens_loaded}} if outcome else None

    def take_stats(self) -> LoadStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, LoadStats()
        return stats


def _bytes_per_token_per_rank(model_config: Any, tensor_parallel_size: int) -> int:
    """KV bytes of one token in one rank's node cache (every rank holds the same number of heads)."""
    rank_shape = KvHeadShard(0, tensor_parallel_size).of(KvShape.from_config(model_config.hf_config))
    return rank_shape.elements_per_token() * model_config.dtype.itemsize
