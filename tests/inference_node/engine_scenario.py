"""Runs real vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler and worker connectors in one
process, reachable by the test) through what the node cache can go wrong with, and prints one JSON object.

    python -m tests.inference_node.engine_scenario MEMORY_SERVICE MODEL_DIR METRICS_URL USER_ID

Steps, each compared with the same prompt prefilled as text:
- cold: the directory knows nothing, the load goes async and fetches;
- lost: the worker's cache loses the entries the directory holds resident: the synchronous load must be refused
  (no FetchKv on the engine thread) and recomputed;
- refetch: the directory dropped them, so the next load goes async and fetches again;
- stale: the worker's entry for the fact is replaced by a shorter one (other token ids): refused, recomputed.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import urllib.request

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("INFERSCALE_NODE_PLAN_SECRET", secrets.token_hex(32))

QUESTION = "def answer(question):"


def fetch_calls(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("inferscale_rpc_requests_total{") and 'method="FetchKv"' in line)


def main(memory_service: str, model_dir: str, metrics_url: str, user_id: str) -> None:
    import grpc
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from inference_node.__main__ import kv_transfer_config
    from inference_node.memory_prompt import plan_memory
    from inference_node.node_cache import CachedKv
    from inference_node.plan import PlanSigner, plan_secret_from_env, provable_prefix
    from inference_node.settings import NodeSettings
    from inferscale.v1 import memory_pb2 as pb
    from inferscale.v1 import memory_pb2_grpc
    from inferscale_kv.layout import memory_header_ids, memory_header_text
    from inferscale_kv.model_profile import build_model_profile

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    profile = build_model_profile(model_dir, tokenizer, "float32", 0)
    settings = NodeSettings(memory_service=memory_service, node_id="engine-scenario", model_dir=model_dir,
                            profile=profile.as_dict())
    llm = LLM(model=model_dir, dtype="float32", max_model_len=1024, seed=0, enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(**kv_transfer_config(settings)))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
    worker = get_kv_transfer_group()._worker

    with grpc.insecure_channel(memory_service) as channel:
        retrieved = memory_pb2_grpc.MemoryServiceStub(channel).RetrieveAndStage(pb.RetrieveAndStageRequest(
            user_id=user_id, query=QUESTION, top_k=5, profile=pb.KvProfile(**profile.as_dict()), node_id="scenario"))
    header_ids = memory_header_ids(tokenizer)
    plan = plan_memory(list(retrieved.facts), header_ids, retrieved.header_content_id, profile.profile_id, user_id)
    prompt_ids = list(tokenizer.encode(memory_header_text(tokenizer) + plan.block_text + QUESTION,
                                       add_special_tokens=False))
    signer = PlanSigner(plan_secret_from_env())
    sampling = dict(max_tokens=8, temperature=0, logprobs=1)

    def generate(with_plan: bool) -> dict:
        extra = {"kv_transfer_params": signer.kv_transfer_params(plan.plan)} if with_plan else None
        prompt = {"prompt_token_ids": prompt_ids}
        if with_plan:
            prompt["cache_salt"] = signer.cache_salt(plan.plan)
        (output,) = llm.generate([prompt], SamplingParams(**sampling, extra_args=extra), use_tqdm=False)
        completion = output.outputs[0]
        return {"tokens": list(completion.token_ids),
                "logprobs": [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)],
                "external_tokens": output.num_cached_tokens or 0}

    _, chunks = provable_prefix(prompt_ids, plan.plan, profile.profile_id)
    chunk_keys = [chunk.key for chunk in chunks]
    result = {"kv_facts": plan.kv_facts, "text": generate(False), "chunks": len(chunk_keys)}

    def step(name: str) -> None:
        before = fetch_calls(metrics_url)
        result[name] = generate(True)
        result[name]["fetches"] = fetch_calls(metrics_url) - before
        result[name]["resident_after"] = [scheduler._directory.is_resident(key) for key in chunk_keys]

    step("cold")
    worker._cache.remove(chunk_keys)  # the worker lost them; the directory still says resident
    result["lost_resident_before"] = [scheduler._directory.is_resident(key) for key in chunk_keys]
    step("lost")
    step("refetch")
    fact = chunks[-1]
    entry = worker._cache.get(fact.key, fact.token_ids)
    shorter = fact.token_ids[:-3]
    worker._cache.remove([fact.key])
    worker._cache.put(fact.key, CachedKv(entry.keys[:, :-3].contiguous(), entry.values[:, :-3].contiguous(), shorter))
    step("stale")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
