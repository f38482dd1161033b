"""The scheduler role on its own (vLLM's Request and scheduler output stand-ins carry only the fields it reads),
the engine-start refusals, and the node's device-memory carve-out."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from inference_node.__main__ import within_gpu_memory_budget
from inference_node.connector import check_supported
from inference_node.connector.scheduler import InferScaleScheduler
from inference_node.plan import PLAN_SECRET_ENV, LoadPlan, PlanFact, PlanHeader, PlanSigner
from inference_node.settings import NodeSettings
from inferscale_kv.kv_key import content_id
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


def _vllm_config(pipeline_parallel_size: int = 1, **model_overrides) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                           pipeline_parallel_size=pipeline_parallel_size),
                           model_config=_model_config(**model_overrides), speculative_config=None)


@pytest.fixture
def scheduler(monkeypatch) -> InferScaleScheduler:
    monkeypatch.setenv(PLAN_SECRET_ENV, SECRET.hex())
    settings = NodeSettings(memory_service="-", node_id="n", model_dir="-", profile={"profile_id": PROFILE},
                            node_cache_mb=1, synchronous_loads=True)
    return InferScaleScheduler(_vllm_config(), settings)


def _request(request_id: str, signer: PlanSigner = SIGNER, salt: str | None = None, lora=None,
             sign: bool = True) -> SimpleNamespace:
    plan = LoadPlan(PROFILE, "u1", PlanHeader(content_id(PROFILE, [], HEADER), tuple(HEADER)),
                    (PlanFact("f", 1, content_id(PROFILE, HEADER, FACT), tuple(FACT)),))
    params = signer.kv_transfer_params(plan) if sign else {"inferscale": {"plan": plan.to_wire()}}
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=PROMPT,
                           cache_salt=signer.cache_salt(plan) if salt is None else salt, lora_request=lora)


def _refused(scheduler: InferScaleScheduler) -> int:
    stats = scheduler.take_stats()
    return 0 if stats is None else stats.data["plans_refused"]


def test_a_signed_plan_with_its_own_salt_claims_the_memory_prefix(scheduler) -> None:
    claim, load_async = scheduler.get_num_new_matched_tokens(_request("r1"), 0)
    assert claim == len(HEADER + FACT) and load_async  # nothing resident yet: the fetch goes async
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


def _send(scheduler: InferScaleScheduler, request: SimpleNamespace) -> None:
    """Admits the request with its claim, as vLLM's scheduler does, and builds the step's metadata."""
    claim, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2],)), claim)
    output = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
    assert [spec.request_id for spec in scheduler.build_connector_meta(output).loads] == [request.request_id]


def test_a_chunk_counts_resident_only_once_its_async_load_finished(scheduler) -> None:
    _send(scheduler, _request("r1"))
    # Sent but not finished: a second request must not load synchronously.
    assert scheduler.get_num_new_matched_tokens(_request("r2"), 0)[1] is True
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"r1"}, invalid_block_ids=set()))
    assert scheduler.get_num_new_matched_tokens(_request("r3"), 0) == (len(HEADER + FACT), False)


def test_chunks_already_in_vllms_prefix_cache_are_neither_staged_nor_needed_resident(scheduler) -> None:
    request = _request("r1")
    assert scheduler.get_num_new_matched_tokens(request, len(HEADER)) == (len(FACT), True)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([0, 1, 2],)), len(FACT))
    output = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]))
    (spec,) = scheduler.build_connector_meta(output).loads
    assert [chunk.key.fact_id for chunk in spec.chunks] == ["f"] and (spec.start, spec.end) == (4, 7)
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"r1"}, invalid_block_ids=set()))
    # The fact is resident now, the header never was: a request with the header cached locally loads at once.
    assert scheduler.get_num_new_matched_tokens(_request("r2"), len(HEADER)) == (len(FACT), False)
    assert scheduler.get_num_new_matched_tokens(_request("r3"), 0)[1] is True


def test_a_failed_async_load_leaves_its_chunks_cold_and_its_request_unclaimed(scheduler) -> None:
    request = _request("r1")
    _send(scheduler, request)
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"r1"}, invalid_block_ids={1}))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # vLLM recomputes it
    assert scheduler.get_num_new_matched_tokens(_request("r2"), 0)[1] is True


def test_a_load_failed_on_one_rank_stays_failed_when_the_last_rank_reports_it_finished(scheduler) -> None:
    """Regression: under tensor parallelism vLLM passes a rank's failed blocks on in the step that rank reports
    them, but the request as finished only once every rank did; the finished step carried no failed blocks, so
    the chunks became resident and the next load ran synchronously against a rank that lacks them."""
    request = _request("r1")
    _send(scheduler, request)
    scheduler.update_connector_output(SimpleNamespace(finished_recving=set(), invalid_block_ids={1}))
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"r1"}, invalid_block_ids=set()))
    assert scheduler.get_num_new_matched_tokens(_request("r2"), 0)[1] is True  # still cold: async again
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # vLLM recomputes it


def test_without_synchronous_loads_resident_chunks_load_on_the_async_path(monkeypatch) -> None:
    monkeypatch.setenv(PLAN_SECRET_ENV, SECRET.hex())
    settings = NodeSettings(memory_service="-", node_id="n", model_dir="-", profile={"profile_id": PROFILE},
                            node_cache_mb=1, synchronous_loads=False)
    scheduler = InferScaleScheduler(_vllm_config(), settings)
    _send(scheduler, _request("r1"))
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"r1"}, invalid_block_ids=set()))
    assert scheduler.get_num_new_matched_tokens(_request("r2"), 0) == (len(HEADER + FACT), True)


@pytest.mark.parametrize(("flag", "device_bytes", "synchronous"), [
    ("auto", None, True), ("auto", 80 * (1 << 30), False), ("on", 80 * (1 << 30), True), ("off", None, False)])
def test_synchronous_loads_are_off_on_cuda_unless_asked_for(tiny_llama_dir, monkeypatch, flag, device_bytes,
                                                             synchronous) -> None:
    import inference_node.__main__ as node_main

    monkeypatch.setattr(node_main, "cuda_device_bytes", lambda: device_bytes)
    settings = node_main.plan_launch(["--model", str(tiny_llama_dir), "--synchronous-loads", flag]).settings
    assert settings.synchronous_loads is synchronous


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


def test_engine_start_refuses_speculative_decoding_and_other_kv_cache_layouts() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    drafted = _vllm_config()
    drafted.speculative_config = SimpleNamespace(method="eagle")
    with pytest.raises(ValueError, match="speculative decoding"):
        check_supported(drafted)
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=64)

    def layout(*specs) -> SimpleNamespace:
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
