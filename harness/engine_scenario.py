"""Runs real vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler and worker connectors in one
process, reachable here) through every way a synchronous load could be refused or diverge, with the faults
injected, and prints one JSON object (`RESULT {...}`):

    python -m harness.engine_scenario service MEMORY_SERVICE MODEL_DIR METRICS_URL USER_ID
    python -m harness.engine_scenario local MODEL_DIR [DTYPE]          # a GPU check: KV encoded here, no service

Every step's greedy output is compared (by the caller) with the same prompt prefilled as text; a defect step must
instead fail its request with an error while the engine serves the next one. Steps, in order:
- cold: nothing resident; the request waits (vLLM skips it) while its chunks are prefetched on a fetch thread, then
  loads synchronously;
- warm: resident: admitted with its load at the first ask, no fetch;
- shared: two requests with the same plan at once, chunks cold: one prefetch, both load;
- intruder: between the answer and the allocation something asks for the whole node cache: the request's held
  chunks are not evicted;
- partial_hit: vLLM's prefix cache holds the memory's first block (same plan salt, another question): the load
  starts inside a chunk;
- full_prompt: the prompt is all memory: the claim stops before its last token;
- mismatch: a plan names a resident key with other token ids: claims nothing;
- fetch_fails / fetch_slow: the prefetch raises / outlasts the wait: the request claims nothing (prefilled);
- aborted: the request is aborted while its prefetch runs; the next one waits for that same fetch;
- lost / stale / device_error (defects): the worker's cache lost an entry the directory holds resident, holds a
  shorter one, or the write raises: vLLM fails the request (kv_load_failure_policy=fail); the next request
  fetches again and loads.
The local mode reads KV encoded here through the same prefetch path (a KV source standing in for the service):
made for the GPU (benchmarks/gpu_failure_path.py), also under vLLM's model runners (VLLM_USE_V2_MODEL_RUNNER).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, cast

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("INFERSCALE_NODE_PLAN_SECRET", secrets.token_hex(32))

QUESTION = "def answer(question):"
OTHER_QUESTION = "class Question:"
LOCAL_FACT = "Hana builds kites from bamboo and rice paper."
UNREACHABLE = "127.0.0.1:9"  # discard port: nothing serves gRPC there
FETCH_TIMEOUT_S = 3.0  # the scheduler waits this + PREFETCH_GRACE_S for a prefetch
SLOW_FETCH_S = 8.0  # longer than that
HOST_TIER_MB = 64
BLOCK_SIZE = 32  # vLLM CPU attention needs a multiple of 32


def service_fetch_calls(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("inferscale_rpc_requests_total{") and 'method="FetchKv"' in line)


def retrieved_from_service(memory_service: str, profile, user_id: str) -> tuple[list, str]:
    import grpc

    from inferscale.v1 import memory_pb2 as pb
    from inferscale.v1 import memory_pb2_grpc

    with grpc.insecure_channel(memory_service) as channel:
        retrieved = memory_pb2_grpc.MemoryServiceStub(channel).RetrieveAndStage(pb.RetrieveAndStageRequest(
            user_id=user_id, query=QUESTION, top_k=5, profile=pb.KvProfile(**profile.as_dict()), node_id="scenario"))
    return list(retrieved.facts), retrieved.header_content_id


def encoded_here(model_dir: str, tokenizer, profile, user_id: str, device: str):
    """One fact's and the header's KV encoded in this process, as a worker would (w=0), and the facts as
    RetrieveAndStage would return them."""
    from inferscale.v1 import memory_pb2 as pb
    from inferscale_kv.kv_key import content_id, header_key
    from inferscale_kv.layout import fact_token_ids, memory_header_ids
    from precompute_worker.encoder import EncodingGroup, FactEncoder, FactKey, FactSpec

    encoder = FactEncoder.from_pretrained(model_dir, "float32", device)
    header_ids, fact_ids = memory_header_ids(tokenizer), fact_token_ids(tokenizer, LOCAL_FACT)
    header, fact = encoder.encode([
        EncodingGroup([], [FactSpec(FactKey("_profile", "header", 1), header_ids, 0)]),
        EncodingGroup(list(header_ids), [FactSpec(FactKey(user_id, "f0", 1), fact_ids, len(header_ids))])])
    fact_content = content_id(profile.profile_id, fact.context_ids, fact_ids)
    retrieved = pb.RetrievedFact(fact_id="f0", version=1, text=LOCAL_FACT, score=1.0, rank=1, kv_ready=True,
                                 token_ids=fact_ids, content_id=fact_content)
    header_content = header_key(profile.profile_id, header_ids).content_id
    del encoder
    return [retrieved], header_content, {header_content: header, fact_content: fact}


class ScenarioKv:
    """The worker's KV source with faults to inject: it records the thread of every fetch, and fails or stalls on
    demand; otherwise it asks `base` (the memory service, or KV encoded here)."""

    def __init__(self, base) -> None:
        self.base = base
        self.threads: list[str] = []
        self.fault = ""  # "" | "fail" | "slow" | "gate" (waits for `gate`)
        self.gate = threading.Event()

    def fetch(self, user_id, chunks, dtype, *, user_token=""):
        self.threads.append(threading.current_thread().name)
        if self.fault == "fail":
            raise LookupError("injected: the memory service is unreachable")
        if self.fault == "slow":
            time.sleep(SLOW_FETCH_S)
        if self.fault == "gate":
            self.gate.wait(60)
        return self.base(user_id, chunks, dtype, user_token=user_token)


def main(mode: str, args: list[str]) -> None:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig
    from vllm.config.model import ModelDType
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.outputs import KVConnectorOutput

    from inference_node.__main__ import kv_transfer_config
    from inference_node.connector import InferScaleConnector
    from inference_node.kv_fetch import CachedKv
    from inference_node.memory_prompt import FactLines, plan_memory
    from inference_node.plan import ChunkLoad, LoadPlan, PlanFact, PlanSigner, plan_secret_from_env, provable_prefix
    from inference_node.settings import NodeSettings
    from inferscale_kv.kv_key import KvKey
    from inferscale_kv.layout import memory_header_ids, memory_header_text
    from inferscale_kv.model_profile import build_model_profile
    from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
    from inferscale_kv.stored_text import StoredTextGuard

    if mode == "service":
        memory_service, model_dir, metrics_url, user_id = args[:4]
        dtype: ModelDType = "float32"
    else:
        memory_service, metrics_url, user_id = UNREACHABLE, "", "gpu-user"
        model_dir, dtype = args[0], cast(ModelDType, args[1] if len(args) > 1 else "float32")  # vLLM checks it
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    profile = build_model_profile(Path(model_dir), tokenizer, "float32", DEFAULT_CONTEXT_WINDOW)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    local_kv = {}
    if mode == "service":
        facts, header_content_id = retrieved_from_service(memory_service, profile, user_id)
    else:
        facts, header_content_id, local_kv = encoded_here(model_dir, tokenizer, profile, user_id, device)
    settings = NodeSettings(memory_service=memory_service, node_id="engine-scenario", model_dir=model_dir,
                            profile=profile.as_dict(), fetch_timeout_s=FETCH_TIMEOUT_S, node_cache_mb=1,
                            host_tier_mb=HOST_TIER_MB, kv_miss_policy="wait")
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=1024, seed=0, enable_prefix_caching=True,
              block_size=BLOCK_SIZE, gpu_memory_utilization=0.3,
              kv_transfer_config=KVTransferConfig(**kv_transfer_config(settings)))
    engine = llm.llm_engine.engine_core
    assert isinstance(engine, InprocClient)  # VLLM_ENABLE_V1_MULTIPROCESSING=0
    vllm_scheduler = engine.engine_core.scheduler
    assert isinstance(vllm_scheduler, Scheduler)
    scheduler_side, worker_side = vllm_scheduler.get_kv_connector(), get_kv_transfer_group()
    assert isinstance(scheduler_side, InferScaleConnector) and isinstance(worker_side, InferScaleConnector)
    scheduler, worker = scheduler_side._scheduler, worker_side._worker
    assert scheduler is not None and worker is not None
    directory = scheduler._directory

    def local_fetch(user, chunks, in_dtype, *, user_token="") -> list[CachedKv]:
        return [CachedKv(local_kv[chunk.key.content_id].keys.to("cpu", in_dtype).contiguous(),
                         local_kv[chunk.key.content_id].values.to("cpu", in_dtype).contiguous(), chunk.token_ids)
                for chunk in chunks]

    source = ScenarioKv(worker._residency._fetch if mode == "service" else local_fetch)
    worker._residency._fetch = source.fetch

    # Spies: the connector's answers per request (how many times "not yet", the claims, whether any was async), and
    # after how many of vLLM's scheduling passes each request was admitted (1: in the first step after it arrived).
    answers: dict[str, dict[str, Any]] = {}
    passes: Counter[str] = Counter()
    admitted_after: dict[str, int] = {}
    ask, schedule = scheduler.get_num_new_matched_tokens, vllm_scheduler.schedule

    def answering(request, num_computed_tokens):
        claim, load_async = ask(request, num_computed_tokens)
        seen = answers.setdefault(request.request_id, {"waits": 0, "claims": [], "async": False})
        if claim is None:
            seen["waits"] += 1
        else:
            seen["claims"].append(claim)
        seen["async"] = seen["async"] or load_async
        return claim, load_async

    def scheduling(*a, **kw):
        for request_id in vllm_scheduler.requests:
            if request_id not in admitted_after:
                passes[request_id] += 1
        output = schedule(*a, **kw)
        for new in output.scheduled_new_reqs:
            admitted_after.setdefault(new.req_id, passes[new.req_id])
        return output

    scheduler.get_num_new_matched_tokens = answering  # type: ignore[method-assign]
    vllm_scheduler.schedule = scheduling

    header_ids = memory_header_ids(tokenizer)
    plan = plan_memory(facts, header_ids, header_content_id, profile.profile_id, user_id,
                       lines=FactLines(StoredTextGuard.for_tokenizer(tokenizer)))
    prompt_of = {question: list(tokenizer.encode(memory_header_text(tokenizer) + plan.block_text + question,
                                                 add_special_tokens=False))
                 for question in (QUESTION, OTHER_QUESTION)}
    signer = PlanSigner(plan_secret_from_env())
    chunks = provable_prefix(prompt_of[QUESTION], plan.plan, profile.profile_id).chunks
    chunk_keys = [chunk.key for chunk in chunks]

    def prompt(ids: list[int], load_plan: LoadPlan | None) -> TokensPrompt:
        tokens = TokensPrompt(prompt_token_ids=ids)
        if load_plan is not None:
            tokens["cache_salt"] = signer.cache_salt(load_plan)
        return tokens

    def sampling(load_plan: LoadPlan | None) -> SamplingParams:
        extra = {"kv_transfer_params": signer.kv_transfer_params(load_plan)} if load_plan is not None else None
        return SamplingParams(max_tokens=8, temperature=0, logprobs=1, extra_args=extra)

    def of_request(spied: dict, external_id: str):
        """What a spy recorded for a request, by the id vLLM's frontend gave it (the engine's adds a suffix)."""
        return next((value for key, value in spied.items() if key == external_id
                     or key.startswith(f"{external_id}-")), None)

    def outcome(output) -> dict[str, object]:
        completion = output.outputs[0]
        logprobs = completion.logprobs or []  # none for a request that failed
        return {"tokens": list(completion.token_ids), "finish_reason": completion.finish_reason,
                "logprobs": [entry[token].logprob for entry, token in zip(logprobs, completion.token_ids, strict=True)],
                "external_tokens": output.num_cached_tokens or 0,
                **(of_request(answers, output.request_id) or {}),
                "admitted_after": of_request(admitted_after, output.request_id)}

    def generate(*requests: tuple[list[int], LoadPlan | None]) -> list[dict[str, object]]:
        llm.reset_prefix_cache()  # every step loads what it names, unless it asks for a local hit itself
        outputs = llm.generate([prompt(ids, load_plan) for ids, load_plan in requests],
                               [sampling(load_plan) for _, load_plan in requests], use_tqdm=False)
        return [outcome(output) for output in outputs]

    def resident() -> list[bool]:
        return [directory.is_resident(chunk) for chunk in chunks]

    def forget() -> None:
        """The directory drops the chunks (they leave every rank's cache with the next step's metadata)."""
        directory.drop(chunk_keys)

    result: dict[str, object] = {
        "mode": mode, "device": device, "dtype": dtype, "kv_facts": plan.kv_facts, "chunks": len(chunk_keys),
        "memory_tokens": sum(len(chunk.token_ids) for chunk in chunks), "fact_tokens": len(chunks[-1].token_ids),
        "model_runner_v2": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", ""),
        "text": generate((prompt_of[QUESTION], None))[0],
        "text_other": generate((prompt_of[OTHER_QUESTION], None))[0]}

    def step(name: str, *requests: tuple[list[int], LoadPlan | None]) -> None:
        fetches, before = len(source.threads), service_fetch_calls(metrics_url) if metrics_url else 0.0
        outcomes = generate(*requests)
        for index, got in enumerate(outcomes):
            got["fetch_attempts"] = len(source.threads) - fetches
            if metrics_url:
                got["fetches"] = service_fetch_calls(metrics_url) - before
            got["resident_after"] = resident()
            result[name if index == 0 else f"{name}_{index}"] = got

    def wait_settled(timeout_s: float = 60.0) -> None:
        """Lets a prefetch that outlived its requests settle: what an engine step does, without a request (an idle
        engine takes no steps)."""
        deadline = time.monotonic() + timeout_s
        while (any(directory.fetch_id(key) is not None or key in directory._warming for key in chunk_keys)
               and time.monotonic() < deadline):
            scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.build_worker_meta()))
            time.sleep(0.05)

    kv = (prompt_of[QUESTION], plan.plan)
    step("cold", kv)
    step("warm", kv)
    step("off", (prompt_of[QUESTION], None))
    forget()
    step("shared", kv, kv)

    def intruding(request, num_computed_tokens):
        """Right after the answer, a prefetch wants the whole node cache: only unheld chunks may make room."""
        answer = answering(request, num_computed_tokens)
        tokens = (directory.budget_bytes - directory.bytes_used) // directory.bytes_per_token + 1
        intruder = ChunkLoad(KvKey(profile.profile_id, "intruder", "f", 1, "0" * 32), tuple(range(tokens)), 0)
        result["intruder_admitted"] = directory.prefetch("intruder", [intruder], time.monotonic(), 60)
        return answer

    scheduler.get_num_new_matched_tokens = intruding  # type: ignore[method-assign]
    step("intruder", kv)
    scheduler.get_num_new_matched_tokens = answering  # type: ignore[method-assign]

    generate(kv)  # vLLM's prefix cache now holds the memory's blocks under the plan's salt: keep them this once
    outputs = llm.generate([prompt(prompt_of[OTHER_QUESTION], plan.plan)], [sampling(plan.plan)], use_tqdm=False)
    result["partial_hit"] = {**outcome(outputs[0]), "resident_after": resident()}

    full_prompt = [token for chunk in chunks for token in chunk.token_ids]
    result["text_full_prompt"] = generate((full_prompt, None))[0]
    step("full_prompt", (full_prompt, plan.plan))

    fact = chunks[-1]
    other_ids = (*fact.token_ids[:-1], (fact.token_ids[-1] + 1) % tokenizer.vocab_size)
    mismatch_plan = LoadPlan(plan.plan.profile_id, plan.plan.user_id, plan.plan.header,
                             (PlanFact(fact.key.fact_id, fact.key.version, fact.key.content_id, other_ids),))
    mismatch_prompt = [*chunks[0].token_ids, *other_ids, *prompt_of[QUESTION][fact.offset + len(fact.token_ids):]]
    result["text_mismatch"] = generate((mismatch_prompt, None))[0]
    step("mismatch", (mismatch_prompt, mismatch_plan))

    forget()
    source.fault = "fail"
    step("fetch_fails", kv)
    source.fault = "slow"
    step("fetch_slow", kv)  # falls back after FETCH_TIMEOUT_S + PREFETCH_GRACE_S; the fetch settles later
    source.fault = ""
    wait_settled()
    result["fetch_slow_resident_later"] = resident()

    forget()
    source.fault = "gate"
    llm.reset_prefix_cache()
    aborted_id, fetches_before = "aborted", len(source.threads)
    llm.llm_engine.add_request(aborted_id, prompt(*kv), sampling(plan.plan))
    deadline = time.monotonic() + 30
    while not any(directory.fetch_id(key) is not None for key in chunk_keys) and time.monotonic() < deadline:
        llm.llm_engine.step()
    llm.llm_engine.abort_request([aborted_id])
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    result["aborted_fetching"] = [directory.fetch_id(key) is not None for key in chunk_keys]
    result["aborted_holds"] = len(directory._holds)
    while len(source.threads) == fetches_before and time.monotonic() < deadline:  # its fetch thread is in
        time.sleep(0.01)
    source.gate.set()
    source.fault = ""
    step("aborted", kv)  # waits for the aborted request's prefetch, which settles now

    worker._cache.remove(chunk_keys)  # a defect: the worker lost what the directory holds resident
    result["lost_resident_before"] = resident()
    step("lost", kv)
    step("after_lost", kv)
    entry = worker._cache.get(fact.key, fact.token_ids)
    assert entry is not None  # fetched again by after_lost
    worker._cache.remove([fact.key])
    worker._cache.put(fact.key, CachedKv(entry.keys[:, :-3].contiguous(), entry.values[:, :-3].contiguous(),
                                         tuple(fact.token_ids[:-3])))
    result["stale_resident_before"] = resident()
    step("stale", kv)
    step("after_stale", kv)
    write = worker._write

    def failing_write(*a, **kw):
        worker._write = write  # type: ignore[method-assign]
        raise RuntimeError("CUDA error: injected device fault")

    worker._write = failing_write  # type: ignore[method-assign]
    step("device_error", kv)
    step("after_device_error", kv)

    # The host tier: a chunk the device tier evicted under pressure comes back by a copy, not a fetch.
    step("host_warm", kv)  # resident in both tiers (fetched again after the defect above)
    result["on_host_before"] = [directory.is_on_host(chunk) for chunk in chunks]
    directory._device.evict(chunk_keys)  # as under pressure: the device tier alone lets them go
    step("from_host", kv)
    # The miss policy: the header resident, the fact in neither tier. best-effort (and auto, where the service's
    # bytes are measured slower than prefill) loads the header at once and prefills the fact; wait waits.
    for name, policy, source_rate in (("best_effort", "best-effort", None), ("auto_slow", "auto", 1.0),
                                      ("auto_fast", "auto", 1e15)):
        directory._device.evict([fact.key])
        directory._host.evict([fact.key])
        scheduler._miss_policy.mode = policy
        if source_rate is not None:
            scheduler._miss_policy.source_bytes.per_second = source_rate
            scheduler._miss_policy.prefill_tokens.per_second = 1.0 if source_rate > 1 else 1e9
        step(name, kv)
        wait_settled()
        result[f"{name}_resident_later"] = resident()
        result[f"{name}_on_host_later"] = [directory.is_on_host(chunk) for chunk in chunks]
    result["fetch_threads"] = sorted(set(source.threads))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
