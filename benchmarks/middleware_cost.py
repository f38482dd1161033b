"""What a memory request costs in InferScale's own code before vLLM queues it, per request, on this machine's CPU:

    python -m benchmarks.middleware_cost [--model DIR] [--k 10 50] [--clauses 2 8] [--requests 200] [--profile]

- middleware: the node's ASGI middleware from the request body in to the rewritten body handed to vLLM (JSON parse,
  client-plan stripping, the memory block and load plan, the plan's signature and cache salt, JSON serialize), with
  the memory service answered at once by a stand-in (its RetrieveAndStage time is not ours to count here);
- scheduler: the connector's proof of the same request in vLLM's engine process (plan signature and salt checked,
  the plan proven against the prompt's token ids), which runs on the engine's scheduling thread;
- vLLM tokenizing: what tokenizing the memory prompt as text costs (vLLM skips it where a request in a memory mode
  arrives as token ids: a completions prompt, or a chat prompt's ids beside its messages where vLLM takes them).
Facts are the serving benchmark's synthetic ones (`--clauses` per fact; k=50 of 2 clauses is ~1,700 memory tokens
with SmolLM2's tokenizer, of 8 clauses ~7,000). `--profile` prints cProfile's top functions for the largest k.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import secrets
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.synthetic import synthetic_facts
from inference_node.plan import PLAN_SECRET_ENV
from inference_node.settings import SETTINGS_ENV, NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.kv_key import content_id, header_key
from inferscale_kv.layout import fact_token_ids, memory_header_ids

PROFILE_ID = "kvp-middleware-cost"
USER = "cost-user"
QUESTION = "Which course did Ana sign up for last weekend?"


class _Service:
    """RetrieveAndStage answered at once with the same facts."""

    def __init__(self, response: pb.RetrieveAndStageResponse) -> None:
        self.response = response

    async def RetrieveAndStage(self, request: pb.RetrieveAndStageRequest, **_: Any) -> pb.RetrieveAndStageResponse:
        return self.response


def retrieved(tokenizer, k: int, clauses: int) -> pb.RetrieveAndStageResponse:
    header_ids = memory_header_ids(tokenizer)
    facts = []
    for rank, text in enumerate(synthetic_facts(k, 7, clauses), start=1):
        ids = fact_token_ids(tokenizer, text)
        facts.append(pb.RetrievedFact(fact_id=f"f{rank}", version=1, text=text, score=1.0 / rank, rank=rank,
                                      kv_ready=True, token_ids=ids, content_id=content_id(PROFILE_ID, [rank], ids)))
    return pb.RetrieveAndStageResponse(facts=facts,
                                       header_content_id=header_key(PROFILE_ID, header_ids).content_id)


def _middleware(model_dir: Path, tokenizer, response: pb.RetrieveAndStageResponse):
    from inference_node.middleware import MemoryMiddleware
    from inference_node.placement import PromptParts
    from inference_node.retrieval import RetrievalBatcher

    async def app(scope, receive, send) -> None:
        message = await receive()
        app.body = message["body"]  # type: ignore[attr-defined]

    settings = NodeSettings(memory_service="-", node_id="cost", model_dir=str(model_dir),
                            profile={"profile_id": PROFILE_ID, "model": "m"}, kv_crossover_tokens=0)
    os.environ[SETTINGS_ENV] = settings.to_json()
    os.environ.setdefault(PLAN_SECRET_ENV, secrets.token_hex(32))
    middleware = MemoryMiddleware(app)
    # What its first request would load, with the memory service's stand-in in place of the channel.
    middleware._placement._parts = PromptParts.for_tokenizer(tokenizer)
    middleware._retriever._batcher = RetrievalBatcher(_Service(response), (), settings.retrieve_timeout_s)
    return middleware, app


def time_middleware(middleware, body: bytes, path: str, count: int) -> list[float]:
    """Milliseconds per request through the middleware (its own work: the service stand-in answers at once)."""
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")]}

    async def one() -> float:
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if delivered:
                return {"type": "http.disconnect"}
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            return

        started = time.perf_counter()
        await middleware(scope, receive, send)
        return (time.perf_counter() - started) * 1000

    async def run() -> list[float]:
        return [await one() for _ in range(count)]

    return asyncio.run(run())


def time_scheduler(rewritten: dict, prompt_ids: list[int], count: int) -> list[float]:
    """Milliseconds per request of the connector's proof in the engine process (verify, salt, prove)."""
    from inference_node.connector.scheduler import InferScaleScheduler

    model_config = SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=8,
                                                             hidden_size=8, num_attention_heads=1),
                                   dtype=SimpleNamespace(itemsize=2))
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1), model_config=model_config,
                                  device_config=SimpleNamespace(device_type="cpu"))
    settings = NodeSettings(memory_service="-", node_id="cost", model_dir="-", profile={"profile_id": PROFILE_ID})
    scheduler = InferScaleScheduler(vllm_config, settings)
    samples = []
    for index in range(count):
        request = SimpleNamespace(request_id=str(index), kv_transfer_params=rewritten["kv_transfer_params"],
                                  cache_salt=rewritten["cache_salt"], prompt_token_ids=prompt_ids, lora_request=None)
        started = time.perf_counter()
        proof = scheduler._proof(request)
        samples.append((time.perf_counter() - started) * 1000)
        assert proof.end > 0, "the plan proved nothing"
    return samples


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return (time.perf_counter() - started) * 1000


def _p50(samples: list[float]) -> float:
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="tokenizer folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--k", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--clauses", type=int, nargs="+", default=[2, 8], help="clauses per fact (2: ~34 tokens)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="cProfile the largest k and clauses")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from demo.smollm2 import build_smollm2
    from inferscale_kv.layout import memory_header_text

    model_dir = (args.model or build_smollm2()).resolve()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"{'route':<22}{'k':>4}{'clauses':>8}{'memory tokens':>15}{'middleware p50 ms':>19}{'scheduler p50 ms':>18}"
          f"{'vLLM tokenizing ms':>20}")
    last: tuple[Any, bytes, str] | None = None
    for clauses in args.clauses:
        for k in args.k:
            response = retrieved(tokenizer, k, clauses)
            middleware, app = _middleware(model_dir, tokenizer, response)
            memory_tokens = len(memory_header_ids(tokenizer)) + sum(len(f.token_ids) for f in response.facts)
            for path, body in (
                    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": QUESTION}],
                                              "max_tokens": 32, "memory": {"user_id": USER, "top_k": k}}),
                    ("/v1/completions", {"model": "m", "prompt": QUESTION, "max_tokens": 32,
                                         "memory": {"user_id": USER, "top_k": k}})):
                raw = json.dumps(body).encode()
                middleware_ms = time_middleware(middleware, raw, path, args.requests)
                rewritten = json.loads(app.body)
                text = (memory_header_text(tokenizer) + "".join(fact.text.strip() + "\n" for fact in response.facts)
                        + QUESTION)
                tokenizing_ms = [_timed(lambda: tokenizer.encode(text, add_special_tokens=False))  # noqa: B023
                                 for _ in range(20)]
                vllm_tokenizing = f"{_p50(tokenizing_ms):.3f}"
                if path == "/v1/completions":
                    prompt_ids = rewritten["prompt"]
                else:  # the rendered prompt's ids beside the messages, where the node sends them
                    prompt_ids = rewritten["kv_transfer_params"].get("prompt_token_ids", text)
                if isinstance(prompt_ids, list):
                    vllm_tokenizing = "0 (token ids)"
                else:
                    prompt_ids = tokenizer.encode(prompt_ids, add_special_tokens=False)
                scheduler_ms = f"{_p50(time_scheduler(rewritten, prompt_ids, args.requests)):.3f}"
                print(f"{path:<22}{k:>4}{clauses:>8}{memory_tokens:>15}{_p50(middleware_ms):>19.3f}"
                      f"{scheduler_ms:>18}{vllm_tokenizing:>20}", flush=True)
                last = (middleware, raw, path)
    if args.profile and last is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        time_middleware(*last, count=args.requests)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
