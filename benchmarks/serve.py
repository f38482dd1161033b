"""Serving benchmark: memory as KV vs as text vs no memory, side by side in one run, through the OpenAI API.

    python -m benchmarks.serve [--k 10 50] [--users 4] [--requests 8] [--concurrency 1]

Starts a memory service, a precompute worker and an inference node (SmolLM2-135M-Instruct, fp32, CPU) unless
pointed at running ones, gives each simulated user a memory of synthetic facts, and asks questions closed-loop
at the given concurrency in each mode. Per (mode, k) it reports query-to-first-token (client-measured: retrieval
+ staging + compose + engine), engine TTFT (that minus the node's RetrieveAndStage time), TPOT, request
throughput and injected tokens, with kv/text ratios; writes JSON and a PNG of TTFT vs k.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.stats import percentiles_ms
from benchmarks.synthetic import synthetic_facts, synthetic_queries
from demo.smollm2 import build_smollm2
from inference_node.launcher import InferenceNodeProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from memory_service.launcher import MemoryServiceProcess
from precompute_worker.progress import wait_for_kv

MODES = ("kv", "text", "off")


@dataclass
class Sample:
    mode: str
    k: int
    query_to_first_token_s: float
    engine_ttft_s: float
    tpot_s: float
    total_s: float
    prompt_tokens: int
    injected_tokens: int


def one_request(client, model: str, user: str, question: str, mode: str, k: int, max_tokens: int) -> Sample:
    started = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"memory": {"user_id": user, "mode": mode, "top_k": k}, "ignore_eos": True},
    ) as response:
        summary = json.loads(response.headers.get("x-inferscale-memory", "{}"))
        for chunk in response.parse():
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                first = first or time.perf_counter()
                chunks += 1
            if chunk.usage:
                usage = chunk.usage
    end = time.perf_counter()
    first = first or end
    stage_s = summary.get("stage_ms", 0.0) / 1000
    details = usage.prompt_tokens_details if usage else None
    generated = usage.completion_tokens if usage else chunks
    return Sample(mode, k, first - started, first - started - stage_s,
                  (end - first) / max(generated - 1, 1), end - started, usage.prompt_tokens if usage else 0,
                  (details.cached_tokens or 0) if details else 0)


def summarize(samples: list[Sample], wall_s: float) -> dict:
    return {
        "requests": len(samples),
        "query_to_first_token_ms": percentiles_ms([s.query_to_first_token_s for s in samples]),
        "engine_ttft_ms": percentiles_ms([s.engine_ttft_s for s in samples]),
        "tpot_ms": percentiles_ms([s.tpot_s for s in samples]),
        "throughput_rps": len(samples) / wall_s,
        "mean_prompt_tokens": sum(s.prompt_tokens for s in samples) / len(samples),
        "mean_injected_tokens": sum(s.injected_tokens for s in samples) / len(samples),
    }


def ingest_users(stub, users: list[str], facts_per_user: int) -> None:
    for n, user in enumerate(tqdm(users, desc="ingesting users", unit="user")):
        facts = synthetic_facts(facts_per_user, seed=1000 + n)
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[pb.FactInput(text=t) for t in facts]))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        ks = sorted(int(k) for k in results[mode])
        axis.plot(ks, [results[mode][str(k)]["query_to_first_token_ms"]["p50"] for k in ks], marker="o", label=mode)
    axis.set_xlabel("facts in memory (k)")
    axis.set_ylabel("query-to-first-token p50 (ms)")
    axis.set_title("InferScale: memory as KV vs as text")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--facts-per-user", type=int, default=60)
    parser.add_argument("--requests", type=int, default=8, help="requests per (mode, k)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", type=Path, default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--output", type=Path, default=Path("results/serve"))
    parser.add_argument("--node-flags", default="--dtype float32 --max-model-len 4096",
                        help="vLLM flags for the node")
    args = parser.parse_args()

    model_dir = (args.model or build_smollm2()).resolve()
    users = [f"bench-user-{i}" for i in range(args.users)]
    questions = synthetic_queries(args.requests * len(args.k) * len(MODES), seed=5)
    results: dict[str, dict[str, dict]] = {mode: {} for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="inferscale-serve-") as workdir:
        work = Path(workdir)
        service = MemoryServiceProcess(work / "data", work / "memory_service.log").start()
        node = None
        try:
            with service.channel() as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                ingest_users(stub, users, args.facts_per_user)
                worker = subprocess.Popen([sys.executable, "-m", "precompute_worker", "--memory-service",
                                           service.address, "--model", str(model_dir), "--exit-when-idle"],
                                          stdout=subprocess.DEVNULL, stderr=(work / "worker.log").open("wb"))
                wait_for_kv(stub, len(users) * args.facts_per_user, worker)
                worker.wait(timeout=600)
            print("starting the inference node ...", flush=True)
            node = InferenceNodeProcess(service.address, model_dir, work / "node", *args.node_flags.split()).start()
            from openai import OpenAI

            client = OpenAI(base_url=f"{node.base_url}/v1", api_key="bench", timeout=600)
            for mode in MODES:  # warm-up: compile paths, fill the node cache once per mode
                one_request(client, str(model_dir), users[0], "warm up", mode, max(args.k), args.max_tokens)
            question_index = 0
            with tqdm(total=len(MODES) * len(args.k) * args.requests, desc="requests", unit="req") as progress:
                for k in args.k:
                    for mode in MODES:  # contenders interleaved per k, in one run
                        jobs = [(users[i % len(users)], questions[question_index + i]) for i in range(args.requests)]
                        question_index += args.requests
                        started = time.perf_counter()
                        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                            samples = list(pool.map(lambda job, mode=mode, k=k: one_request(
                                client, str(model_dir), job[0], job[1], mode, k, args.max_tokens), jobs))
                        progress.update(len(samples))
                        results[mode][str(k)] = summarize(samples, time.perf_counter() - started)
        finally:
            if node is not None:
                node.stop()
            service.stop()

    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                          "results": results}, indent=2))
    plot(results, args.output / "ttft_vs_k.png")
    print(f"\n{'=' * 20} InferScale serving benchmark ({model_dir.name}, concurrency {args.concurrency}) {'=' * 20}")
    for k in args.k:
        print(f"\n---------------- k = {k} facts ----------------")
        print(f"{'mode':<6}{'QtFT p50':>10}{'p90':>8}{'p99':>8}{'engine TTFT p50':>17}{'TPOT p50':>10}"
              f"{'req/s':>8}{'prompt tok':>12}{'injected':>10}")
        for mode in MODES:
            row = results[mode][str(k)]
            q, e, t = row["query_to_first_token_ms"], row["engine_ttft_ms"], row["tpot_ms"]
            print(f"{mode:<6}{q['p50']:>10.1f}{q['p90']:>8.1f}{q['p99']:>8.1f}{e['p50']:>17.1f}{t['p50']:>10.1f}"
                  f"{row['throughput_rps']:>8.2f}{row['mean_prompt_tokens']:>12.0f}{row['mean_injected_tokens']:>10.0f}")
        kv, text = results["kv"][str(k)], results["text"][str(k)]
        print(f"ratios kv/text: query-to-first-token p50 "
              f"{kv['query_to_first_token_ms']['p50'] / text['query_to_first_token_ms']['p50']:.2f}, engine TTFT p50 "
              f"{kv['engine_ttft_ms']['p50'] / text['engine_ttft_ms']['p50']:.2f}, throughput "
              f"{kv['throughput_rps'] / text['throughput_rps']:.2f}x")
    print(f"\nJSON: {args.output / 'results.json'}   plot: {args.output / 'ttft_vs_k.png'}")


if __name__ == "__main__":
    main()
