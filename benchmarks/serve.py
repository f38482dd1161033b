"""Serving benchmark: memory as KV vs as text vs no memory, side by side in one run, through the OpenAI API.

    python -m benchmarks.serve [--k 10 50] [--users 4] [--requests 8] [--concurrency 1 8]
    python -m benchmarks.serve --shape llama3-8b --kv-dtype bfloat16 --node-flags "..."     # GPU speed run

Starts a memory service, a precompute worker and an inference node (SmolLM2-135M-Instruct, fp32, CPU by
default), gives each simulated user a memory of synthetic facts, and asks questions closed-loop at each
concurrency in each mode. Per (concurrency, mode, k) it reports query-to-first-token (client-measured:
retrieval + staging + compose + engine), engine TTFT (that minus the node's RetrieveAndStage time), TPOT,
request throughput, injected tokens and the node-cache hit rate, with kv/text ratios; with --load-stats also
the connector's own time per warm load (staging from the node cache, compose, cache writes). Writes JSON and a
PNG of TTFT vs k. `--shape llama3-8b` serves a Llama-3-8B-shaped model with DUMMY weights and SYNTHETIC fact KV
(random, uploaded by the real worker pipeline); every report of such a run says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.dummy_model import SHAPES, build_dummy_model
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


def node_counters(base_url: str) -> dict[str, float]:
    """The node's connector counters (inferscale_connector_*_total, summed over label sets)."""
    import urllib.request

    totals: dict[str, float] = {}
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("inferscale_connector_") and "_total{" in line:
                name = line[len("inferscale_connector_") : line.index("_total{")]
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    lookups = after.get("node_cache_lookups", 0.0) - before.get("node_cache_lookups", 0.0)
    return (after.get("node_cache_hits", 0.0) - before.get("node_cache_hits", 0.0)) / lookups if lookups else None


def connector_phases(stats_path: Path, chunks: int) -> dict | None:
    """p50 of the connector's per-load phases over warm loads (every chunk in the node cache) of `chunks` chunks."""
    if not stats_path.exists():
        return None
    loads = [json.loads(line) for line in stats_path.read_text().splitlines()]
    warm = [load for load in loads if load["chunks"] == chunks and not load["node_cache_misses"]]
    if not warm:
        return None
    return {"loads": len(warm), "tokens_p50": statistics.median(load["tokens"] for load in warm),
            **{f"{phase}_p50": statistics.median(load[phase] for load in warm)
               for phase in ("ms", "stage_ms", "compose_ms", "write_ms")}}


def run_mode(client, model: str, jobs: list[tuple[str, str]], mode: str, k: int, concurrency: int,
             max_tokens: int, base_url: str) -> dict:
    before = node_counters(base_url)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        samples = list(pool.map(lambda job: one_request(client, model, job[0], job[1], mode, k, max_tokens), jobs))
    row = summarize(samples, time.perf_counter() - started)
    row["node_cache_hit_rate"] = hit_rate(before, node_counters(base_url)) if mode == "kv" else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--facts-per-user", type=int, default=60)
    parser.add_argument("--requests", type=int, default=8, help="requests per (concurrency, mode, k)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", type=Path, default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="serve this shape with dummy weights and synthetic fact KV (tokenizer from --model)")
    parser.add_argument("--kv-dtype", default="float32", help="the worker's compute and storage dtype")
    parser.add_argument("--load-stats", action="store_true",
                        help="record the connector's per-load phases (synchronizes the device per load)")
    parser.add_argument("--output", type=Path, default=Path("results/serve"))
    parser.add_argument("--node-flags", default="--dtype float32 --max-model-len 4096",
                        help="vLLM flags for the node")
    args = parser.parse_args()

    tokenizer_dir = (args.model or build_smollm2()).resolve()
    synthetic = args.shape is not None
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="inferscale-serve-") as workdir:
        work = Path(workdir)
        model_dir = build_dummy_model(work / args.shape, args.shape, tokenizer_dir, args.kv_dtype) if synthetic else tokenizer_dir
        users = [f"bench-user-{i}" for i in range(args.users)]
        questions = iter(synthetic_queries(args.requests * len(args.k) * len(MODES) * len(args.concurrency), seed=5))
        stats_path = work / "loads.jsonl"
        service = MemoryServiceProcess(work / "data", work / "memory_service.log").start()
        node = None
        try:
            with service.channel() as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                ingest_users(stub, users, args.facts_per_user)
                worker_module = "benchmarks.synthetic_worker" if synthetic else "precompute_worker"
                worker = subprocess.Popen([sys.executable, "-m", worker_module, "--memory-service", service.address,
                                           "--model", str(model_dir), "--dtype", args.kv_dtype, "--exit-when-idle"],
                                          stdout=subprocess.DEVNULL, stderr=(work / "worker.log").open("wb"))
                wait_for_kv(stub, len(users) * args.facts_per_user, worker)
                worker.wait(timeout=600)
            print("starting the inference node ...", flush=True)
            node_flags = [*args.node_flags.split(), "--kv-dtype", args.kv_dtype]
            if synthetic:
                node_flags += ["--load-format", "dummy"]
            if args.load_stats:
                node_flags += ["--load-stats-path", str(stats_path)]
            node = InferenceNodeProcess(service.address, model_dir, work / "node", *node_flags).start()
            from openai import OpenAI

            client = OpenAI(base_url=f"{node.base_url}/v1", api_key="bench", timeout=600)
            for user in users:  # warm-up: compile paths; every fact of every user reaches the node cache once
                for mode in MODES:
                    one_request(client, str(model_dir), user, "warm up", mode, args.facts_per_user, args.max_tokens)
            stats_path.unlink(missing_ok=True)
            total = len(args.concurrency) * len(MODES) * len(args.k) * args.requests
            with tqdm(total=total, desc="requests", unit="req") as progress:
                for concurrency in args.concurrency:
                    for k in args.k:
                        for mode in MODES:  # contenders interleaved per k, in one run
                            jobs = [(users[i % len(users)], next(questions)) for i in range(args.requests)]
                            row = run_mode(client, str(model_dir), jobs, mode, k, concurrency, args.max_tokens,
                                           node.base_url)
                            results.setdefault(str(concurrency), {mode: {} for mode in MODES})[mode][str(k)] = row
                            progress.update(len(jobs))
            phases = {str(k): connector_phases(stats_path, k + 1) for k in args.k} if args.load_stats else {}
        finally:
            if node is not None:
                node.stop()
            service.stop()

    label = (f"{args.shape} shape, DUMMY weights, SYNTHETIC fact KV ({args.kv_dtype})" if synthetic
             else f"{model_dir.name}, {args.kv_dtype}")
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "results.json").write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(args).items()}, "model": label, "synthetic_kv": synthetic,
        "results": results, "connector_phases": phases}, indent=2))
    plot(results[str(args.concurrency[0])], args.output / "ttft_vs_k.png")
    for concurrency in args.concurrency:
        report(results[str(concurrency)], args.k, f"{label}, concurrency {concurrency}")
    for k, row in phases.items():
        if row:
            print(f"connector per warm load, k={k} ({row['tokens_p50']:.0f} tokens, {row['loads']} loads): "
                  f"{row['ms_p50']:.2f} ms p50 = staging {row['stage_ms_p50']:.2f} + compose "
                  f"{row['compose_ms_p50']:.2f} + cache writes {row['write_ms_p50']:.2f}")
    print(f"\nJSON: {args.output / 'results.json'}   plot: {args.output / 'ttft_vs_k.png'}")


def report(results: dict, ks: list[int], title: str) -> None:
    """vLLM-bench-style blocks, one per k, and the kv/text ratios."""
    print(f"\n{'=' * 16} InferScale serving benchmark ({title}) {'=' * 16}")
    for k in ks:
        print(f"\n---------------- k = {k} facts ----------------")
        print(f"{'mode':<6}{'QtFT p50':>10}{'p90':>8}{'p99':>8}{'engine TTFT p50':>17}{'p90':>8}{'p99':>8}"
              f"{'TPOT p50':>10}{'req/s':>8}{'prompt tok':>12}{'injected':>10}{'node hit':>10}")
        for mode in MODES:
            row = results[mode][str(k)]
            q, e, t = row["query_to_first_token_ms"], row["engine_ttft_ms"], row["tpot_ms"]
            hit = row.get("node_cache_hit_rate")
            print(f"{mode:<6}{q['p50']:>10.1f}{q['p90']:>8.1f}{q['p99']:>8.1f}{e['p50']:>17.1f}{e['p90']:>8.1f}"
                  f"{e['p99']:>8.1f}{t['p50']:>10.1f}{row['throughput_rps']:>8.2f}{row['mean_prompt_tokens']:>12.0f}"
                  f"{row['mean_injected_tokens']:>10.0f}{'' if hit is None else f'{hit:.2f}':>10}")
        kv, text = results["kv"][str(k)], results["text"][str(k)]
        print(f"ratios kv/text: query-to-first-token p50 "
              f"{kv['query_to_first_token_ms']['p50'] / text['query_to_first_token_ms']['p50']:.2f}, engine TTFT p50 "
              f"{kv['engine_ttft_ms']['p50'] / text['engine_ttft_ms']['p50']:.2f}, throughput "
              f"{kv['throughput_rps'] / text['throughput_rps']:.2f}x")


if __name__ == "__main__":
    main()
