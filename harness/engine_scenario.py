"""Runs real vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler and worker connectors in one
process, reachable by the test) through what the node cache can go wrong with, and prints one JSON object.

    python -m harness.engine_scenario service MEMORY_SERVICE MODEL_DIR METRICS_URL USER_ID
    python -m harness.engine_scenario local MODEL_DIR [DTYPE [sync|async]]  # a GPU check: no service

Steps, each compared with the same prompt prefilled as text:
- cold (service): the directory knows nothing, the load goes async and fetches;
- warm (local): the fact KV is encoded here and put in the worker's cache, the directory holds it resident, and
  the load is synchronous;
- lost: the worker's cache loses the entries the directory holds resident: the synchronous load must be refused
  (no fetch on the engine thread) and recomputed;
- refetch (service): the directory dropped them, so the next load goes async and fetches again;
- stale: the worker's entry for the fact is replaced by a shorter one (other token ids): refused, recomputed;
- fetch_fails (local): the chunks are cold and the memory service unreachable: the async load fails, recomputed.
The local mode exercises vLLM's failure path for synchronous loads (kv_load_failure_policy="recompute") on the
stack it runs on, e.g. vLLM on a GPU with Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1); with `async` the node's
synchronous loads are off (NodeSettings.synchronous_loads), so the same failures take the async path.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import urllib.request
from pathlib import Path
from typing import cast
from unittest import mock

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("INFERSCALE_NODE_PLAN_SECRET", secrets.token_hex(32))

QUESTION = "def answer(question):"
LOCAL_FACT = "Hana builds kites from bamboo and rice paper."
UNREACHABLE = "127.0.0.1:9"  # discard port: nothing serves gRPC there


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


def main(mode: str, args: list[str]) -> None:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig
    from vllm.config.model import ModelDType
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.engine.core_client import InprocClient

    from inference_node.__main__ import kv_transfer_config
    from inference_node.connector import InferScaleConnector
    from inference_node.connector.node_cache import CachedKv
    from inference_node.memory_prompt import plan_memory
    from inference_node.plan import PlanSigner, plan_secret_from_env, provable_prefix
    from inference_node.settings import NodeSettings
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
    synchronous_loads = (args[2] if mode == "local" and len(args) > 2 else "sync") == "sync"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    profile = build_model_profile(Path(model_dir), tokenizer, "float32", DEFAULT_CONTEXT_WINDOW)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    local_kv = {}
    if mode == "service":
        facts, header_content_id = retrieved_from_service(memory_service, profile, user_id)
    else:
        facts, header_content_id, local_kv = encoded_here(model_dir, tokenizer, profile, user_id, device)
    settings = NodeSettings(memory_service=memory_service, node_id="engine-scenario", model_dir=model_dir,
                            profile=profile.as_dict(), fetch_timeout_s=5.0, synchronous_loads=synchronous_loads)
    llm = LLM(model=model_dir, dtype=dtype, max_model_len=1024, seed=0, enable_prefix_caching=False,
              gpu_memory_utilization=0.3, kv_transfer_config=KVTransferConfig(**kv_transfer_config(settings)))
    engine = llm.llm_engine.engine_core
    assert isinstance(engine, InprocClient)  # VLLM_ENABLE_V1_MULTIPROCESSING=0
    scheduler_side, worker_side = engine.engine_core.scheduler.get_kv_connector(), get_kv_transfer_group()
    assert isinstance(scheduler_side, InferScaleConnector) and isinstance(worker_side, InferScaleConnector)
    scheduler, worker = scheduler_side._scheduler, worker_side._worker
    assert scheduler is not None and worker is not None

    header_ids = memory_header_ids(tokenizer)
    plan = plan_memory(facts, header_ids, header_content_id, profile.profile_id, user_id,
                       guard=StoredTextGuard.for_tokenizer(tokenizer))
    prompt_ids = list(tokenizer.encode(memory_header_text(tokenizer) + plan.block_text + QUESTION,
                                       add_special_tokens=False))
    signer = PlanSigner(plan_secret_from_env())
    # Spies for the rest of the run: they count the worker's fetch attempts and refused loads, and pass through.
    fetches = mock.patch.object(worker._stager, "_fetch", wraps=worker._stager._fetch).start()
    refusals = mock.patch.object(worker, "_fail", wraps=worker._fail).start()

    def generate(with_plan: bool) -> dict[str, object]:
        extra = {"kv_transfer_params": signer.kv_transfer_params(plan.plan)} if with_plan else None
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if with_plan:
            prompt["cache_salt"] = signer.cache_salt(plan.plan)
        sampling = SamplingParams(max_tokens=8, temperature=0, logprobs=1, extra_args=extra)
        (output,) = llm.generate([prompt], sampling, use_tqdm=False)
        completion = output.outputs[0]
        assert completion.logprobs is not None  # requested: one entry per generated token
        # vLLM types FlatLogprobs' entries optional, though a generated token's entry is always there.
        return {"tokens": list(completion.token_ids),
                "logprobs": [entry[token].logprob  # type: ignore[index]
                             for entry, token in zip(completion.logprobs, completion.token_ids, strict=True)],
                "external_tokens": output.num_cached_tokens or 0}

    chunks = provable_prefix(prompt_ids, plan.plan, profile.profile_id).chunks
    chunk_keys = [chunk.key for chunk in chunks]
    result: dict[str, object] = {
        "mode": mode, "device": device, "dtype": dtype, "kv_facts": plan.kv_facts, "chunks": len(chunk_keys),
        "synchronous_loads": synchronous_loads, "model_runner_v2": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", ""),
        "text": generate(False)}

    def resident() -> list[bool]:
        return [scheduler._directory.is_resident(key) for key in chunk_keys]

    def step(name: str) -> None:
        attempts, before = fetches.call_count, service_fetch_calls(metrics_url) if metrics_url else 0.0
        refused = refusals.call_count
        outcome = generate(True)
        outcome["fetch_attempts"] = fetches.call_count - attempts
        if metrics_url:
            outcome["fetches"] = service_fetch_calls(metrics_url) - before
        outcome["loads_refused"] = refusals.call_count - refused
        outcome["resident_after"] = resident()
        result[name] = outcome

    def make_resident() -> None:
        """Local mode: the encoded KV in the worker's cache and the directory, as a finished fetch leaves them."""
        for chunk in chunks:
            encoded = local_kv[chunk.key.content_id]
            worker._cache.put(chunk.key, CachedKv(encoded.keys.to(device, getattr(torch, dtype)).contiguous(),
                                                  encoded.values.to(device, getattr(torch, dtype)).contiguous(),
                                                  tuple(chunk.token_ids)))
        scheduler._directory.start_fetch(((c.key, len(c.token_ids)) for c in chunks), set())
        scheduler._directory.settle(chunk_keys, True)

    if mode == "service":
        step("cold")
    else:
        make_resident()
        step("warm")
    worker._cache.remove(chunk_keys)  # the worker lost them; the directory still says resident
    result["lost_resident_before"] = resident()
    step("lost")
    if mode == "service":
        step("refetch")
    else:
        make_resident()  # as after a fetch
    fact = chunks[-1]
    entry = worker._cache.get(fact.key, fact.token_ids)
    assert entry is not None  # resident: encoded here or fetched
    worker._cache.remove([fact.key])
    worker._cache.put(fact.key, CachedKv(entry.keys[:, :-3].contiguous(), entry.values[:, :-3].contiguous(),
                                         tuple(fact.token_ids[:-3])))
    result["stale_resident_before"] = resident()
    step("stale")
    if mode == "local":
        worker._cache.remove(chunk_keys)
        scheduler._directory.drop(chunk_keys)
        step("fetch_fails")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
