"""The scheduler role on its own (vLLM's Request, scheduler output and connector output stand-ins carry only the
fields it reads; `_step` plays one pass of vLLM's scheduler), the engine-start refusals, and the node's device-memory
carve-out."""

import json
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from inference_node.__main__ import within_gpu_memory_budget
from inference_node.connector import check_supported
from inference_node.connector.metadata import InferScaleConnectorMetadata, PrefetchReport
from inference_node.connector.miss_policy import MissPolicy
from inference_node.connector.scheduler import BACKGROUND_RETRY_S, PREFETCH_GRACE_S, InferScaleScheduler
from inference_node.plan import PLAN_SECRET_ENV, ChunkLoad, LoadPlan, PlanFact, PlanHeader, PlanSigner
from inference_node.settings import NodeSettings
from inferscale_kv.kv_key import KvKey, content_id
from inferscale_kv.rope import UnsupportedRotary

PROFILE = "kvp-roles"
SECRET = b"s" * 32
SIGNER = PlanSigner(SECRET)
HEADER = [1, 2, 3, 4]
FACT = [10, 11, 12]
PROMPT = HEADER + FACT + [99, 98]


def _model_config(**overrides) -> SimpleNamespace:
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                            intermediate_size=128, vocab_size=128, **overrides)
    return SimpleNamespace(hf_config=hf_config, dtype=torch.float32)


def _vllm_config(pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1, failure_policy: str = "fail",
                 **model_overrides) -> Any:
    """vLLM's config as the connector reads it (a stand-in: only those fields)."""
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size,
                                                           pipeline_parallel_size=pipeline_parallel_size),
                           model_config=_model_config(**model_overrides), speculative_config=None,
                           device_config=SimpleNamespace(device_type="cpu"),
                           kv_transfer_config=SimpleNamespace(kv_load_failure_policy=failure_policy))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


def _scheduler(monkeypatch, clock: _Clock, tensor_parallel_size: int = 1, node_cache_mb: int = 1,
               fetch_timeout_s: float = 10.0, kv_miss_policy: str = "wait",
               host_tier_mb: int = 0) -> InferScaleScheduler:
    monkeypatch.setenv(PLAN_SECRET_ENV, SECRET.hex())
    settings = NodeSettings(memory_service="-", node_id="n", model_dir="-", profile={"profile_id": PROFILE},
                            node_cache_mb=node_cache_mb, fetch_timeout_s=fetch_timeout_s,
                            kv_miss_policy=kv_miss_policy, host_tier_mb=host_tier_mb)
    return InferScaleScheduler(_vllm_config(tensor_parallel_size=tensor_parallel_size), settings, clock=clock)


@pytest.fixture
def scheduler(monkeypatch, clock) -> InferScaleScheduler:
    return _scheduler(monkeypatch, clock)


def _plan(fact: tuple[int, ...] = tuple(FACT), content: str | None = None) -> LoadPlan:
    return LoadPlan(PROFILE, "u1", PlanHeader(content_id(PROFILE, [], HEADER), tuple(HEADER)),
                    (PlanFact("f", 1, content or content_id(PROFILE, HEADER, list(fact)), fact),))


def _request(request_id: str, signer: PlanSigner = SIGNER, salt: str | None = None, lora=None,
             sign: bool = True, plan: LoadPlan | None = None, prompt: list[int] | None = None) -> Any:
    """A vLLM Request as the scheduler role reads it."""
    plan = plan or _plan()
    params = signer.kv_transfer_params(plan) if sign else {"inferscale": {"plan": plan.to_wire()}}
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=prompt or PROMPT,
                           cache_salt=signer.cache_salt(plan) if salt is None else salt, lora_request=lora)


@pytest.mark.parametrize("reads_no_cache", [{"skip_reading_prefix_cache": True},
                                            {"sampling_params": SimpleNamespace(prompt_logprobs=0)}])
def test_a_request_vllm_computes_in_full_claims_nothing_and_fetches_nothing(scheduler, reads_no_cache) -> None:
    """vLLM discards a claim for a request that skips the prefix cache (prompt logprobs): it must not hold chunks,
    order prefetches or evict anyone's chunks either."""
    request = _request("r1")
    for name, value in reads_no_cache.items():
        setattr(request, name, value)
    answers, metadata = _step(scheduler, request)
    assert answers == {"r1": 0} and not metadata.prefetches and not metadata.evictions
    assert not scheduler._directory._holds


def _refused(scheduler: InferScaleScheduler) -> int:
    stats = scheduler.take_stats()
    return 0 if stats is None else stats.data["plans_refused"]


def test_a_signed_plan_with_its_own_salt_claims_the_memory_prefix_once_resident(scheduler) -> None:
    assert scheduler.get_num_new_matched_tokens(_request("r1"), 0) == (None, False)  # prefetch first
    assert _refused(scheduler) == 0


@pytest.mark.parametrize("request_kwargs", [
    {"signer": PlanSigner(b"o" * 32)},  # signed under another secret
    {"sign": False},
    {"salt": "isk-forged"},
    {"salt": ""},
    {"lora": SimpleNamespace(lora_name="adapter")},
], ids=["other-secret", "unsigned", "forged-salt", "no-salt", "lora"])
def test_refused_plans_claim_nothing_and_are_counted(scheduler, request_kwargs) -> None:
    assert scheduler.get_num_new_matched_tokens(_request("r1", **request_kwargs), 0) == (0, False)
    assert _refused(scheduler) == 1


_NO_OUTPUT: Any = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]))


def _connector_output(report: PrefetchReport | None, invalid_block_ids: set[int]) -> Any:
    """vLLM's KVConnectorOutput as the scheduler role reads it."""
    return SimpleNamespace(kv_connector_worker_meta=report, invalid_block_ids=invalid_block_ids)


def _blocks(*block_ids: int) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(block_ids),))


def _step(scheduler: InferScaleScheduler, *requests: Any, local_hit: int = 0,
          allocate: bool = True) -> tuple[dict[str, int | None], InferScaleConnectorMetadata]:
    """One pass of vLLM's scheduler over waiting requests: ask, skip on None, allocate and tell the connector
    (unless `allocate` is False: no free blocks), then build the step's metadata."""
    answers: dict[str, int | None] = {}
    for request in requests:
        claim, load_async = scheduler.get_num_new_matched_tokens(request, local_hit)
        assert load_async is False  # never async
        answers[request.request_id] = claim
        if claim is not None and allocate:
            scheduler.update_state_after_alloc(request, _blocks(0, 1, 2), claim)
    return answers, scheduler.build_connector_meta(_NO_OUTPUT)


def _settle(scheduler: InferScaleScheduler, metadata: InferScaleConnectorMetadata, failed: bool = False,
            ranks: int = 1, invalid_blocks: frozenset[int] = frozenset()) -> None:
    """The workers' report of every prefetch in `metadata`, as vLLM's aggregator sums it over `ranks`."""
    keys = Counter({chunk.key: ranks for spec in metadata.prefetches for chunk in spec.chunks})
    report = PrefetchReport(failed=keys) if failed else PrefetchReport(fetched=keys)
    scheduler.update_connector_output(_connector_output(report, set(invalid_blocks)))


def _stats(scheduler: InferScaleScheduler) -> dict[str, int]:
    stats = scheduler.take_stats()
    return dict(stats.data) if stats is not None else {}


MEMORY = len(HEADER + FACT)


def test_a_cold_request_waits_for_its_prefetch_then_loads_synchronously_in_its_admission_step(scheduler) -> None:
    answers, metadata = _step(scheduler, _request("r1"))
    assert answers == {"r1": None} and metadata.loads == []
    (prefetch,) = metadata.prefetches
    assert prefetch.user_id == "u1" and [chunk.key.fact_id for chunk in prefetch.chunks] == ["header", "f"]
    assert _step(scheduler, _request("r1"))[0] == {"r1": None}  # still fetching: asked again, ordered once
    _settle(scheduler, metadata)
    answers, metadata = _step(scheduler, _request("r1"))
    (load,) = metadata.loads
    assert answers == {"r1": MEMORY} and metadata.prefetches == []
    assert (load.start, load.end, load.block_ids) == (0, MEMORY, (0, 1, 2))
    warm_answers, warm = _step(scheduler, _request("r2"))  # resident: admitted with its load at the first ask
    assert warm_answers == {"r2": MEMORY} and len(warm.loads) == 1 and warm.prefetches == []
    stats = _stats(scheduler)
    assert (stats["async_loads"], stats["node_cache_lookups"], stats["node_cache_hits"]) == (1, 4, 2)


def test_requests_sharing_chunks_wait_for_one_prefetch(scheduler) -> None:
    answers, metadata = _step(scheduler, _request("r1"), _request("r2"))
    assert answers == {"r1": None, "r2": None} and len(metadata.prefetches) == 1
    _settle(scheduler, metadata)
    answers, metadata = _step(scheduler, _request("r1"), _request("r2"))
    assert answers == {"r1": MEMORY, "r2": MEMORY} and len(metadata.loads) == 2


@pytest.mark.parametrize("outcome", ["failed", "timed-out", "no-room"])
def test_a_request_whose_prefetch_fails_times_out_or_cannot_fit_claims_nothing_and_is_prefilled(
        monkeypatch, clock, outcome) -> None:
    scheduler = _scheduler(monkeypatch, clock, node_cache_mb=0 if outcome == "no-room" else 1, fetch_timeout_s=1)
    request = _request("r1")
    answers, metadata = _step(scheduler, request)
    if outcome == "failed":
        _settle(scheduler, metadata, failed=True)
        # Another request orders the chunks again before r1 is asked: r1 still learns that its prefetch failed.
        assert _step(scheduler, _request("r0"))[1].evictions  # a failed chunk leaves the ranks that fetched it
    elif outcome == "timed-out":
        # The ranks give up on it too, unfetched, if no fetch thread could start it by then.
        assert [spec.start_within_s for spec in metadata.prefetches] == [1 + PREFETCH_GRACE_S]
        clock.now += 1 + PREFETCH_GRACE_S + 0.1
    if outcome != "no-room":
        assert answers == {"r1": None}
        answers, metadata = _step(scheduler, request)
    assert answers == {"r1": 0} and metadata.loads == []
    stats = _stats(scheduler)
    if outcome == "no-room":  # nothing of it resident: its resident prefix, at once, is nothing
        assert (stats.get("partial_loads"), stats.get("load_failures")) == (1, 0)
    else:
        assert stats.get("load_failures") == 1
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # also when preempted and resumed


def test_a_load_failed_on_one_rank_leaves_its_chunks_cold(monkeypatch, clock) -> None:
    """Under tensor parallelism a chunk is resident only once every rank fetched it; a chunk one rank failed is
    evicted from all (regression, first for async loads: the chunks became resident and the next load ran
    synchronously against a rank that lacked them)."""
    scheduler = _scheduler(monkeypatch, clock, tensor_parallel_size=2)
    _, metadata = _step(scheduler, _request("r1"))
    keys = Counter(chunk.key for spec in metadata.prefetches for chunk in spec.chunks)
    scheduler.update_connector_output(_connector_output(PrefetchReport(fetched=keys), set()))
    assert _step(scheduler, _request("r2"))[0] == {"r2": None}  # one rank of two: not resident
    scheduler.update_connector_output(_connector_output(PrefetchReport(failed=keys), set()))
    answers, metadata = _step(scheduler, _request("r1"), _request("r3"))
    assert answers == {"r1": 0, "r3": None}  # r1 waited for it: prefilled; r3 orders it again
    assert set(metadata.evictions) == set(keys) and len(metadata.prefetches) == 1  # evicted first, then fetched


def test_chunks_are_held_from_the_answer_until_the_load_is_sent(monkeypatch, clock) -> None:
    """A chunk answered for cannot be evicted before its load reaches the workers, not even when vLLM has no
    blocks for the request this step (the answer is given again next step)."""
    scheduler = _scheduler(monkeypatch, clock)
    _, metadata = _step(scheduler, _request("r1"))
    _settle(scheduler, metadata)
    assert len(_step(scheduler, _request("r1"))[1].loads) == 1
    answers, metadata = _step(scheduler, _request("r2"), allocate=False)
    assert answers == {"r2": MEMORY} and metadata.loads == []
    directory = scheduler._directory
    assert not directory.prefetch("u9", [ChunkLoad(KvKey(PROFILE, "u9", "big", 1, "c" * 32), tuple(range(2042)), 0)],
                                  now=0.0, wait_s=10.0)  # no room without evicting r2's held chunks: refused
    assert _step(scheduler, _request("r2"))[0] == {"r2": MEMORY}
    assert directory.prefetch("u9", [ChunkLoad(KvKey(PROFILE, "u9", "big", 1, "c" * 32), tuple(range(2042)), 0)],
                              now=0.0, wait_s=10.0)  # r2's load was sent: its chunks may go (after it, in worker order)


def test_chunks_already_in_vllms_prefix_cache_are_neither_loaded_nor_needed_resident(scheduler) -> None:
    request = _request("r1")
    answers, metadata = _step(scheduler, request, local_hit=len(HEADER))
    assert answers == {"r1": None} and [c.key.fact_id for c in metadata.prefetches[0].chunks] == ["f"]
    _settle(scheduler, metadata)
    answers, metadata = _step(scheduler, request, local_hit=len(HEADER))
    (spec,) = metadata.loads
    assert answers == {"r1": len(FACT)} and [chunk.key.fact_id for chunk in spec.chunks] == ["f"]
    assert (spec.start, spec.end) == (4, 7)
    assert _step(scheduler, _request("r2"))[0] == {"r2": None}  # the header was never fetched


def test_a_local_hit_inside_a_chunk_loads_from_there_and_nothing_past_the_last_prompt_token(scheduler) -> None:
    """vLLM cannot take a full-prompt hit (upstream issue 55113): a prompt that is all memory claims all but its
    last token."""
    prompt = HEADER + FACT
    answers, metadata = _step(scheduler, _request("r1", prompt=prompt))
    _settle(scheduler, metadata)
    answers, metadata = _step(scheduler, _request("r1", prompt=prompt), local_hit=2)
    (spec,) = metadata.loads
    assert answers == {"r1": MEMORY - 1 - 2} and (spec.start, spec.end) == (2, MEMORY - 1)
    assert [chunk.key.fact_id for chunk in spec.chunks] == ["header", "f"]


def test_a_known_key_with_other_token_ids_is_not_claimed(scheduler) -> None:
    _, metadata = _step(scheduler, _request("r1"))
    _settle(scheduler, metadata)
    other = (10, 11, 13)  # the same key (content id) for other tokens: a defect of whoever made the plan
    plan = _plan(other, content=content_id(PROFILE, HEADER, FACT))
    assert _step(scheduler, _request("r2", plan=plan, prompt=HEADER + list(other) + [99]))[0] == {"r2": 0}
    assert _stats(scheduler)["load_failures"] == 1


def test_a_request_aborted_while_its_prefetch_runs_leaves_the_chunks_to_settle(scheduler) -> None:
    request = _request("r1")
    _, metadata = _step(scheduler, request)
    scheduler.request_finished(request)
    _settle(scheduler, metadata)
    assert _step(scheduler, _request("r2"))[0] == {"r2": MEMORY}
    assert not scheduler._directory._holds  # nobody holds anything once the loads were sent


def test_a_failed_synchronous_load_is_a_defect_its_chunks_are_fetched_again(scheduler) -> None:
    _, metadata = _step(scheduler, _request("r1"))
    _settle(scheduler, metadata)
    _, metadata = _step(scheduler, _request("r1"))
    scheduler.update_connector_output(_connector_output(None, {1}))
    assert _stats(scheduler)["load_defects"] == 1
    answers, metadata = _step(scheduler, _request("r2"))
    assert answers == {"r2": None} and len(metadata.evictions) == 2 and len(metadata.prefetches) == 1


def test_the_synchronous_loads_flag_is_deprecated_and_changes_nothing(tiny_llama_dir, monkeypatch, capsys) -> None:
    import inference_node.__main__ as node_main

    monkeypatch.setattr(node_main, "cuda_device_bytes", lambda: 80 * (1 << 30))
    default = node_main.plan_launch(["--model", str(tiny_llama_dir)])
    for flag in ("on", "off"):
        launch = node_main.plan_launch(["--model", str(tiny_llama_dir), "--synchronous-loads", flag])
        assert launch.settings == default.settings
        assert "deprecated" in capsys.readouterr().err
    transfer = json.loads(default.command[default.command.index("--kv-transfer-config") + 1])
    assert transfer["kv_load_failure_policy"] == "fail"


def test_engine_start_refuses_pipeline_parallelism_and_unsupported_rotary() -> None:
    check_supported(_vllm_config())
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_supported(_vllm_config(pipeline_parallel_size=2))
    partial = _vllm_config()
    partial.model_config.hf_config.partial_rotary_factor = 0.5
    with pytest.raises(UnsupportedRotary, match="partial_rotary_factor"):
        check_supported(partial)
    other_family = _vllm_config()
    other_family.model_config.hf_config.model_type = "gpt_neox"
    with pytest.raises(UnsupportedRotary, match="gpt_neox"):
        check_supported(other_family)
    check_supported(_vllm_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    with pytest.raises(UnsupportedRotary, match="'dynamic'"):  # transformers rescales per length, vLLM once
        check_supported(_vllm_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


def test_engine_start_refuses_a_failed_load_being_recomputed() -> None:
    """A node started without `python -m inference_node` (vLLM's own server, a copied config) gets no other policy:
    a synchronous load that fails must fail its request, never reach vLLM's recompute (upstream issue 49250)."""
    with pytest.raises(ValueError, match="kv_load_failure_policy='fail', got 'recompute'"):
        check_supported(_vllm_config(failure_policy="recompute"))
    no_transfer = _vllm_config()
    no_transfer.kv_transfer_config = None
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        check_supported(no_transfer)


def test_engine_start_refuses_speculative_decoding_and_other_kv_cache_layouts() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    drafted = _vllm_config()
    drafted.speculative_config = SimpleNamespace(method="eagle")
    with pytest.raises(ValueError, match="speculative decoding"):
        check_supported(drafted)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=64)

    def layout(*specs) -> Any:
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    check_supported(_vllm_config(), layout(full))
    for specs in ((full, window), (window,)):
        with pytest.raises(ValueError, match="one KV cache group of full attention"):
            check_supported(_vllm_config(), layout(*specs))


GIB = 1 << 30


def test_the_node_cache_is_carved_out_of_vllms_device_share() -> None:
    assert within_gpu_memory_budget(["--max-model-len", "64"], 8 * GIB, 80 * GIB) == [
        "--max-model-len", "64", "--gpu-memory-utilization", "0.8000"]  # vLLM's default 0.9 minus 0.1
    assert within_gpu_memory_budget(["--gpu-memory-utilization=0.85"], 4 * GIB, 80 * GIB) == [
        "--gpu-memory-utilization", "0.8000"]
    assert within_gpu_memory_budget(["--gpu-memory-utilization", "0.5", "-tp", "2"], 0, 80 * GIB) == [
        "-tp", "2", "--gpu-memory-utilization", "0.5000"]


def test_a_node_cache_that_leaves_vllm_too_little_is_refused_naming_both_numbers() -> None:
    with pytest.raises(SystemExit, match=r"--node-cache-mb 73728 .*--gpu-memory-utilization 0.9"):
        within_gpu_memory_budget([], 72 * GIB, 80 * GIB)


def test_without_a_cuda_device_vllms_flags_are_unchanged() -> None:
    assert within_gpu_memory_budget(["--gpu-memory-utilization", "0.5"], 64 * GIB, None) == [
        "--gpu-memory-utilization", "0.5"]


def test_a_recomputed_tail_longer_than_any_retrieval_is_refused_at_start(tiny_llama_dir) -> None:
    import inference_node.__main__ as node_main

    with pytest.raises(SystemExit, match="--recompute-tail-facts must be at most 200"):
        node_main.plan_launch(["--model", str(tiny_llama_dir), "--recompute-tail-facts", "201"])


OTHER_FACT = (20, 21, 22)


def _with_header_resident(scheduler: InferScaleScheduler) -> Any:
    """The header resident after a first request's load; a request for another fact of the user, not resident."""
    _, metadata = _step(scheduler, _request("r0"))
    _settle(scheduler, metadata)
    _step(scheduler, _request("r0"))
    return _request("r1", plan=_plan(fact=OTHER_FACT), prompt=HEADER + list(OTHER_FACT) + [99])


@pytest.mark.parametrize("policy", ["best-effort", "auto-slow-bytes"])
def test_a_request_served_at_once_loads_its_resident_prefix_and_its_missing_chunks_come_in_the_background(
        monkeypatch, clock, policy) -> None:
    """The miss policy's partial outcome: the resident header loads now (its load reads the header alone), vLLM
    prefills the fact, whose chunk is fetched with nobody waiting; the user's next request loads it all."""
    scheduler = _scheduler(monkeypatch, clock, kv_miss_policy="best-effort" if policy == "best-effort" else "auto")
    if policy == "auto-slow-bytes":
        scheduler._miss_policy.source_bytes.per_second = 1.0  # the service's bytes measured far slower than prefill
    request = _with_header_resident(scheduler)
    _stats(scheduler)
    answers, metadata = _step(scheduler, request)
    assert answers == {"r1": len(HEADER)}
    (load,) = metadata.loads
    assert (load.start, load.end, [chunk.key.fact_id for chunk in load.chunks]) == (0, len(HEADER), ["header"])
    assert [[chunk.token_ids for chunk in spec.chunks] for spec in metadata.prefetches] == [[OTHER_FACT]]
    assert _stats(scheduler).get("partial_loads") == 1
    assert scheduler.get_num_new_matched_tokens(request, 0) == (len(HEADER), False)  # never waits later either
    _settle(scheduler, metadata)
    answers, _ = _step(scheduler, _request("r2", plan=_plan(fact=OTHER_FACT), prompt=HEADER + list(OTHER_FACT) + [99]))
    assert answers == {"r2": MEMORY}


def test_auto_waits_where_the_missing_bytes_come_faster_than_their_prefill(monkeypatch, clock) -> None:
    scheduler = _scheduler(monkeypatch, clock, kv_miss_policy="auto")
    scheduler._miss_policy.prefill_tokens.per_second = 1.0  # prefill measured far slower than the bytes
    request = _with_header_resident(scheduler)
    answers, metadata = _step(scheduler, request)
    assert answers == {"r1": None} and len(metadata.prefetches) == 1
    _settle(scheduler, metadata)
    assert _step(scheduler, request)[0] == {"r1": MEMORY}
    assert "partial_loads" not in {name for name, count in _stats(scheduler).items() if count}


def test_the_miss_policy_weighs_each_tiers_measured_bandwidth_against_measured_prefill() -> None:
    policy = MissPolicy("auto", on_gpu=True)
    for _ in range(50):  # moving averages reach what is measured
        policy.observe_transfers({"host": 25_000_000, "source": 2_000_000}, {"host": 1_000, "source": 1_000})
        policy.observe_step(4_000, 0.1)  # 40,000 tokens/s
        policy.observe_step(8, 0.05)  # a decode step: says nothing of prefill
    assert policy.host_bytes.per_second == pytest.approx(25e9, rel=1e-3)
    assert policy.source_bytes.per_second == pytest.approx(2e9, rel=1e-3)
    assert policy.prefill_tokens.per_second == pytest.approx(40_000, rel=1e-3)
    # 86 MiB on the host tier: ~3.6 ms + latency, against 700 tokens' 17.5 ms of prefill: wait.
    assert policy.decide(86 << 20, 0, 700).wait
    # The same bytes from the service: ~45 ms: load what is resident, prefill the rest.
    assert not policy.decide(0, 86 << 20, 700).wait
    assert MissPolicy("wait", on_gpu=True).decide(0, 1 << 40, 1).wait
    assert not MissPolicy("best-effort", on_gpu=True).decide(0, 0, 1 << 20).wait


def test_a_signed_warm_up_is_ordered_into_the_host_tier_once_and_a_forged_one_never(monkeypatch, clock) -> None:
    scheduler = _scheduler(monkeypatch, clock, host_tier_mb=1)
    warm = (PlanFact("g", 1, content_id(PROFILE, HEADER, list(OTHER_FACT)), OTHER_FACT),)
    request = _request("r1")
    request.kv_transfer_params = SIGNER.sign(_plan(), warm).kv_transfer_params
    _, metadata = _step(scheduler, request)
    (warm_spec,) = [spec for spec in metadata.prefetches if not spec.to_device]
    assert [chunk.token_ids for chunk in warm_spec.chunks] == [OTHER_FACT] and warm_spec.keep_on_host
    assert _stats(scheduler).get("warmed_chunks") == 1
    _, metadata = _step(scheduler, request)  # asked again: ordered once
    assert not [spec for spec in metadata.prefetches if not spec.to_device]
    forged = _request("r2")
    forged.kv_transfer_params = SIGNER.sign(_plan(), warm).kv_transfer_params
    forged.kv_transfer_params["inferscale"]["warm"][0]["fact_id"] = "h"  # altered after signing
    _, metadata = _step(scheduler, forged)
    assert not [spec for spec in metadata.prefetches if not spec.to_device]
    other = PlanSigner(b"o" * 32)  # another node's secret
    foreign = _request("r3")
    foreign.kv_transfer_params = {"inferscale": {**SIGNER.sign(_plan()).kv_transfer_params["inferscale"],
                                                 **{k: v for k, v in other.sign(_plan(), warm).kv_transfer_params[
                                                     "inferscale"].items() if k.startswith("warm")}}}
    _, metadata = _step(scheduler, foreign)
    assert not [spec for spec in metadata.prefetches if not spec.to_device]


def test_a_chunk_whose_background_fetch_failed_is_not_fetched_again_at_once(monkeypatch, clock) -> None:
    """Review of issue 41: every request of a user served with its resident prefix ordered the chunk the service
    could not give again, each time evicting others' chunks to make room for it."""
    scheduler = _scheduler(monkeypatch, clock, kv_miss_policy="best-effort")
    request = _with_header_resident(scheduler)
    _, metadata = _step(scheduler, request)
    _settle(scheduler, metadata, failed=True)
    nxt = _request("r2", plan=_plan(fact=OTHER_FACT), prompt=HEADER + list(OTHER_FACT) + [99])
    answers, metadata = _step(scheduler, nxt)
    assert answers == {"r2": len(HEADER)} and not metadata.prefetches
    clock.now += BACKGROUND_RETRY_S + 1
    answers, metadata = _step(scheduler, _request("r3", plan=_plan(fact=OTHER_FACT),
                                                  prompt=HEADER + list(OTHER_FACT) + [99]))
    assert len(metadata.prefetches) == 1


def test_a_steps_prefill_time_runs_from_the_later_of_its_build_and_the_previous_output(monkeypatch, clock) -> None:
    """Review of issue 41: under vLLM's async scheduling step N+1 is built before step N's output; pairing the last
    build with the next output timed a decode step's tail against the next step's prefill tokens."""
    scheduler = _scheduler(monkeypatch, clock, kv_miss_policy="auto")
    prior = scheduler._miss_policy.prefill_tokens.per_second
    observed = []
    monkeypatch.setattr(scheduler._miss_policy, "observe_step", lambda tokens, seconds: observed.append(
        (tokens, round(seconds, 6))))
    scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=128))  # step 1 built at 0
    clock.now = 0.001
    scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=10_000))  # step 2 built early
    clock.now = 0.1
    scheduler.update_connector_output(_connector_output(None, set()))  # step 1's output
    clock.now = 1.1
    scheduler.update_connector_output(_connector_output(None, set()))  # step 2's
    assert observed == [(128, 0.1), (10_000, 1.0)] and prior == scheduler._miss_policy.prefill_tokens.per_second
    # Steps of no tokens (every waiting request waiting for its prefetch) reach no connector output: not counted.
    for _ in range(3):
        scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    clock.now = 2.0
    scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=8_000))
    clock.now = 2.2
    scheduler.update_connector_output(_connector_output(None, set()))
    assert observed[-1] == (8_000, 0.2) and not scheduler._steps


def test_an_allocation_never_asked_for_fails_its_request(scheduler) -> None:
    """Review of issue 41: vLLM counts allocated external tokens computed; an allocation the connector never
    answered must not leave its blocks to be read as they are: a load of no chunks, which the worker fails (vLLM then
    fails the request), not nothing."""
    request = _request("r1")
    scheduler.update_state_after_alloc(request, _blocks(0, 1, 2), MEMORY)
    (load,) = scheduler.build_connector_meta(_NO_OUTPUT).loads
    assert load.chunks == () and (load.start, load.end) == (0, MEMORY)


def test_the_request_finished_answer_says_what_became_of_the_memory(monkeypatch, clock) -> None:
    """x-inferscale-memory's `load`: the connector's answer at request_finished, in the response's
    kv_transfer_params (vLLM puts it there)."""
    scheduler = _scheduler(monkeypatch, clock, kv_miss_policy="best-effort")

    def finished(request) -> dict:
        return scheduler.request_finished(request)["inferscale_load"]

    first = _request("r0")
    _, metadata = _step(scheduler, first)  # nothing resident: its resident prefix is nothing, prefilled
    assert finished(first) == {"outcome": "partial", "tokens_loaded": 0}
    _settle(scheduler, metadata)
    resident = _request("r1")
    _step(scheduler, resident)
    assert finished(resident) == {"outcome": "resident", "tokens_loaded": MEMORY}
    cached = _request("r2")
    _step(scheduler, cached, local_hit=MEMORY + 1)
    assert finished(cached) == {"outcome": "prefix_cache", "tokens_loaded": 0}
    refused = _request("r3", signer=PlanSigner(b"o" * 32))
    _step(scheduler, refused)
    assert finished(refused) == {"outcome": "prefilled", "tokens_loaded": 0}
    plain = SimpleNamespace(request_id="r4", kv_transfer_params=None, prompt_token_ids=PROMPT, cache_salt=None,
                            lora_request=None)
    _step(scheduler, plain)
    assert scheduler.request_finished(plain) is None


def test_what_a_partial_load_left_out_comes_into_the_host_tier_and_the_next_request_copies_it(monkeypatch,
                                                                                              clock) -> None:
    """The GPU cold run (benchmarks/RESULTS.md): background fetches into a device tier for two users were refused for
    room, so the users' next requests fetched everything again. With a host tier they go there, evicting nobody's
    device-tier chunk, and the next request loads in the step that admits it, its chunk copied back from the host
    tier first (a later GPU run found such a request waiting a step for its copy: 7 ms of queue)."""
    scheduler = _scheduler(monkeypatch, clock, kv_miss_policy="auto", host_tier_mb=1)
    request = _with_header_resident(scheduler)
    scheduler._miss_policy.source_bytes.per_second = 1.0  # the service's bytes: slower than prefill
    answers, metadata = _step(scheduler, request)
    assert answers == {"r1": len(HEADER)}
    (spec,) = metadata.prefetches
    assert not spec.to_device and [chunk.token_ids for chunk in spec.chunks] == [OTHER_FACT]
    scheduler.update_connector_output(_connector_output(PrefetchReport(warmed=Counter(spec.keep_on_host)), set()))
    nxt = _request("r2", plan=_plan(fact=OTHER_FACT), prompt=HEADER + list(OTHER_FACT) + [99])
    scheduler._miss_policy.prefill_tokens.per_second = 100.0  # (this toy fact is 3 tokens: a real one is ~34)
    answers, metadata = _step(scheduler, nxt)
    assert answers == {"r2": MEMORY} and not metadata.prefetches  # no wait: the copy comes before the load
    assert [chunk.token_ids for chunk in metadata.promotions] == [OTHER_FACT]
    (load,) = metadata.loads
    assert [chunk.token_ids for chunk in load.chunks][-1] == OTHER_FACT


def test_a_host_tier_chunk_is_copied_back_in_the_admitting_step_never_at_the_cost_of_the_requests_own_chunks(
        monkeypatch, clock) -> None:
    """The room a promotion makes never comes from the request's own resident chunks: it holds them first (else its
    header, the least recently used, would be evicted under the load that reads it)."""
    scheduler = _scheduler(monkeypatch, clock, host_tier_mb=1)
    first = _with_header_resident(scheduler)  # the header and FACT resident in both tiers
    _, metadata = _step(scheduler, first)
    _settle(scheduler, metadata)  # OTHER_FACT too, the most recently used
    scheduler.request_finished(first)
    directory = scheduler._directory
    (other,) = metadata.prefetches[0].chunks
    header = next(ChunkLoad(key, entry.token_ids, 0) for key, entry in directory._device.resident.items()
                  if entry.token_ids == tuple(HEADER))
    directory._device.evict([other.key])  # as under pressure: the device tier alone lets it go
    directory.take_evictions()
    directory._device.budget_bytes = directory.bytes_used + len(OTHER_FACT) * directory.bytes_per_token - 1
    answers, metadata = _step(scheduler, _request("r2", plan=_plan(fact=OTHER_FACT),
                                                  prompt=HEADER + list(OTHER_FACT) + [99]))
    assert answers == {"r2": MEMORY} and not metadata.prefetches  # loaded in its first step
    assert metadata.promotions == (other,)
    assert header.key not in metadata.evictions and len(metadata.evictions) == 1  # FACT's chunk made the room
    assert directory.is_resident(header) and directory.is_resident(other)


def test_a_partial_load_copies_back_the_host_tier_chunks_before_the_first_one_it_must_fetch(monkeypatch,
                                                                                          clock) -> None:
    """The miss policy serves the request at once: its resident prefix runs through the chunks the host tier holds
    (copied back in this step) up to the first chunk only the memory service has, which vLLM prefills."""
    scheduler = _scheduler(monkeypatch, clock, host_tier_mb=1)
    request = _with_header_resident(scheduler)
    scheduler._miss_policy.mode = "best-effort"
    directory = scheduler._directory
    header_key = next(iter(directory._device.resident))
    directory._device.evict([header_key])  # the header on the host only, the fact in neither tier
    answers, metadata = _step(scheduler, request)
    assert answers == {"r1": len(HEADER)}
    assert [chunk.token_ids for chunk in metadata.promotions] == [tuple(HEADER)]
    assert [chunk.token_ids for chunk in metadata.prefetches[0].chunks] == [OTHER_FACT]  # for the next request


def test_a_request_that_cannot_load_copies_nothing_back(monkeypatch, clock) -> None:
    """Review of issue 41: a request whose other chunk's prefetch outlived its deadline falls back to prefill; it
    must not order its host-tier chunk copied back first (evicting others' chunks for a load that never comes, and,
    its holds released, leaving a copy the device tier no longer accounts for when the step evicts it again)."""
    scheduler = _scheduler(monkeypatch, clock, host_tier_mb=1)
    _with_header_resident(scheduler)  # the header and FACT in both tiers
    _, waiting = _step(scheduler, _request("r9", plan=_plan(fact=OTHER_FACT), prompt=HEADER + list(OTHER_FACT) + [99]))
    (other,) = waiting.prefetches[0].chunks  # ordered, never settled
    directory = scheduler._directory
    fact = next(ChunkLoad(key, entry.token_ids, len(HEADER)) for key, entry in directory._device.resident.items()
                if entry.token_ids == tuple(FACT))
    directory._device.evict([fact.key])  # FACT on the host only
    clock.now += scheduler._fetch_wait_s + 1  # OTHER_FACT's prefetch outlived its deadline
    both = LoadPlan(PROFILE, "u1", PlanHeader(content_id(PROFILE, [], HEADER), tuple(HEADER)),
                    (PlanFact("f", 1, fact.key.content_id, tuple(FACT)),
                     PlanFact(other.key.fact_id, other.key.version, other.key.content_id, OTHER_FACT)))
    answers, metadata = _step(scheduler, _request("r2", plan=both, prompt=HEADER + FACT + list(OTHER_FACT) + [99]))
    assert answers == {"r2": 0} and metadata.promotions == ()
    assert not directory.is_resident(fact) and directory.is_on_host(fact)


@pytest.mark.parametrize("policy", ["best-effort", "auto"])
def test_a_memory_all_in_the_host_tier_loads_whole_whatever_the_miss_policy(monkeypatch, clock, policy) -> None:
    """Review of issue 41: best-effort (or auto, weighing the copy against prefill) marked such a request partial,
    then copied its chunks back and loaded it whole: answered "partial" with the whole memory loaded."""
    scheduler = _scheduler(monkeypatch, clock, host_tier_mb=1)
    _with_header_resident(scheduler)
    scheduler._miss_policy.mode = policy
    scheduler._miss_policy.prefill_tokens.per_second = 1e12  # prefill looks free: auto would never wait for a copy
    directory = scheduler._directory
    directory._device.evict(list(directory._device.resident))  # the header and FACT on the host only
    _stats(scheduler)
    request = _request("r2")
    answers, metadata = _step(scheduler, request)
    assert answers == {"r2": MEMORY} and len(metadata.promotions) == 2
    assert scheduler.request_finished(request)["inferscale_load"] == {"outcome": "resident", "tokens_loaded": MEMORY}
    assert _stats(scheduler).get("partial_loads", 0) == 0
