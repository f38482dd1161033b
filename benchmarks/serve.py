"""Serving benchmark: memory as KV vs as text vs no memory, side by side in one run, through the OpenAI API.

    python -m benchmarks.serve [--k 5 10 20 50] [--users 4] [--requests 8] [--concurrency 1 8] [--rate 2]
    python -m benchmarks.serve --locomo ../shared/data/locomo/locomo-dev6.json      # LoCoMo facts and questions
    python -m benchmarks.serve --shape llama3-8b --kv-dtype bfloat16 --node-flags "..."     # GPU speed run

Starts a memory service, a precompute worker and an inference node (SmolLM2-135M-Instruct, fp32, CPU by
default), gives each simulated user a memory (synthetic facts of --fact-clauses clauses, ~17 tokens each, or
LoCoMo observations) and asks questions closed-loop at each concurrency and open-loop (Poisson arrivals) at each
rate, in each mode: kv (memory injected as KV), text (the same facts as text, vLLM prefix caching on) and off
(no memory: the floor). Per (load, k, mode) it reports query-to-first-token (client-measured: retrieval +
staging + compose + engine), TTFT (that minus the node's memory step, RetrieveAndStage), vLLM's own engine
TTFT (its time_to_first_token histogram: arrival in the engine to first token, mean), TPOT, request
throughput, prompt and injected tokens and the node-cache hit rate, with kv/text ratios; with --load-stats
also the connector's own time per warm load (staging from the node cache, compose, cache writes). Writes JSON
(after every measurement) and PNGs (TTFT vs k, throughput vs concurrent users). `--shape llama3-8b` serves a
Llama-3-8B-shaped model with DUMMY weights and SYNTHETIC fact KV (random, uploaded by the real worker
pipeline); every report of such a run says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from tqdm import tqdm

from benchmarks.dummy_model import SHAPES, build_dummy_model
from benchmarks.locomo_data import load_locomo
from benchmarks.stats import percentiles_ms
from benchmarks.synthetic import synthetic_facts, synthetic_queries
from demo.smollm2 import build_smollm2
from inference_node.launcher import InferenceNodeProcess
from memory_service.launcher import MemoryServiceProcess
from precompute_worker.progress import wait_for_kv

MODES = ("kv", "text", "off")


@dataclass
class Sample:
    mode: str
    k: int
    query_to_first_token_s: float
    ttft_s: float  # query-to-first-token minus the node's memory step (RetrieveAndStage)
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
        "ttft_ms": percentiles_ms([s.ttft_s for s in samples]),
        "tpot_ms": percentiles_ms([s.tpot_s for s in samples]),
        "throughput_rps": len(samples) / wall_s,
        "mean_prompt_tokens": sum(s.prompt_tokens for s in samples) / len(samples),
        "mean_injected_tokens": sum(s.injected_tokens for s in samples) / len(samples),
    }


@dataclass(frozen=True)
class Workload:
    """Per simulated user: the facts to ingest (and turns, for LoCoMo), and the questions they ask."""

    users: list[str]
    facts: dict[str, list[pb.FactInput]]
    turns: dict[str, list[pb.Turn]]
    questions: dict[str, list[str]]
    source: str

    def jobs(self, count: int, rng: random.Random) -> list[tuple[str, str]]:
        """`count` (user, question) pairs, users round-robin, each user's questions drawn at random."""
        users = itertools.islice(itertools.cycle(self.users), count)
        return [(user, rng.choice(self.questions[user])) for user in users]


def synthetic_workload(users: int, facts_per_user: int, clauses: int) -> Workload:
    names = [f"bench-user-{i}" for i in range(users)]
    return Workload(
        names, {user: [pb.FactInput(text=t) for t in synthetic_facts(facts_per_user, 1000 + n, clauses)]
                for n, user in enumerate(names)},
        {}, {user: synthetic_queries(32, seed=5 + n) for n, user in enumerate(names)},
        f"synthetic facts ({clauses} clause(s) each)")


def locomo_workload(path: Path, users: int, facts_per_user: int) -> Workload:
    """User i replays LoCoMo conversation i mod 6 (its first `facts_per_user` observations, its questions)."""
    conversations = load_locomo(path)
    names, facts, turns, questions = [], {}, {}, {}
    for i in range(users):
        conversation = conversations[i % len(conversations)]
        user = f"bench-{conversation.sample_id}-{i}"
        names.append(user)
        facts[user] = conversation.facts[:facts_per_user]
        turns[user] = conversation.turns
        questions[user] = [q.question for q in conversation.questions]
    return Workload(names, facts, turns, questions, f"LoCoMo ({path.name}) observations and questions")


def ingest(stub, workload: Workload) -> None:
    for user in tqdm(workload.users, desc="ingesting users", unit="user"):
        if workload.turns.get(user):
            stub.IngestTurns(pb.IngestTurnsRequest(user_id=user, turns=workload.turns[user]))
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=workload.facts[user]))


def plot(results: dict, output: Path, title: str) -> list[Path]:
    """TTFT vs k at the first load; throughput vs concurrent users at each k (when several concurrencies ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    first = results[next(iter(results))]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        ks = sorted(int(k) for k in first[mode])
        for axis, metric in zip(axes, ("query_to_first_token_ms", "engine_ttft_ms"), strict=True):
            axis.plot(ks, [first[mode][str(k)][metric]["p50" if metric != "engine_ttft_ms" else "mean"]
                           for k in ks], marker="o", label=mode)
    axes[0].set_ylabel("query-to-first-token p50 (ms)")
    axes[1].set_ylabel("engine TTFT, vLLM mean (ms)")
    for axis in axes:
        axis.set_xlabel("facts retrieved (k)")
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(f"InferScale, {describe(next(iter(results)))}: {title}", fontsize=9)
    figure.tight_layout()
    paths.append(output / "ttft_vs_k.png")
    figure.savefig(paths[-1], dpi=120)
    closed = sorted((int(load[1:]), load) for load in results if load.startswith("c"))
    if len(closed) > 1:
        figure, axis = plt.subplots(figsize=(6, 4))
        for mode in MODES:
            for k in first[mode]:
                axis.plot([c for c, _ in closed], [results[load][mode][k]["throughput_rps"] for _, load in closed],
                          marker="o", label=f"{mode}, k={k}")
        axis.set_xlabel("concurrent users")
        axis.set_ylabel("requests / s")
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        paths.append(output / "throughput_vs_users.png")
        figure.savefig(paths[-1], dpi=120)
    return paths


def parse_counters(metrics_text: str) -> dict[str, float]:
    """The connector counters (inferscale_connector_*_total) and vLLM's TTFT histogram sum/count, summed over
    label sets."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name = None
        if line.startswith("inferscale_connector_") and "_total{" in line:
            name = line[len("inferscale_connector_") : line.index("_total{")]
        elif line.startswith(("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")):
            name = "ttft_" + line[len("vllm:time_to_first_token_seconds_") :].split("{")[0].split(" ")[0]
        if name:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def node_counters(base_url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return parse_counters(response.read().decode())


def engine_ttft_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """vLLM's own TTFT over a run, from its histogram's sum and count (mean; percentiles need the buckets)."""
    count = after.get("ttft_count", 0.0) - before.get("ttft_count", 0.0)
    mean = (after.get("ttft_sum", 0.0) - before.get("ttft_sum", 0.0)) / count * 1000 if count else float("nan")
    return {"mean": mean, "requests": count}


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


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Open-loop arrival times (s from the start) of a Poisson process at `rate` requests/s."""
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def run_mode(client, model: str, jobs: list[tuple[str, str]], mode: str, k: int, load: str, max_tokens: int,
             base_url: str) -> dict:
    """One contender at one load: "c<N>" = closed loop with N in flight, "r<R>" = open loop at R requests/s."""
    before = node_counters(base_url)
    ask = lambda job: one_request(client, model, job[0], job[1], mode, k, max_tokens)
    started = time.perf_counter()
    if load.startswith("c"):
        with ThreadPoolExecutor(max_workers=int(load[1:])) as pool:
            samples = list(pool.map(ask, jobs))
    else:
        offsets = arrival_offsets(len(jobs), float(load[1:]), random.Random(len(jobs)))
        with ThreadPoolExecutor(max_workers=min(len(jobs), 256)) as pool:
            futures = []
            for offset, job in zip(offsets, jobs, strict=True):
                time.sleep(max(0.0, started + offset - time.perf_counter()))
                futures.append(pool.submit(ask, job))
            samples = [future.result() for future in futures]
    row = summarize(samples, time.perf_counter() - started)
    after = node_counters(base_url)
    row["engine_ttft_ms"] = engine_ttft_ms(before, after)
    row["node_cache_hit_rate"] = hit_rate(before, after) if mode == "kv" else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[5, 10, 20, 50])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--facts-per-user", type=int, default=60)
    parser.add_argument("--fact-clauses", type=int, default=1, help="synthetic facts: ~17 tokens per clause")
    parser.add_argument("--locomo", type=Path, default=None, help="LoCoMo JSON: its observations and questions")
    parser.add_argument("--requests", type=int, default=8, help="requests per (load, k, mode)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1], help="closed-loop loads")
    parser.add_argument("--rate", type=float, nargs="*", default=[], help="open-loop loads (requests/s, Poisson)")
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
    parser.add_argument("--service-flags", default="", help="memory service flags (e.g. --embedding-threads 4)")
    args = parser.parse_args()

    tokenizer_dir = (args.model or build_smollm2()).resolve()
    synthetic = args.shape is not None
    loads = [f"c{c}" for c in args.concurrency] + [f"r{r:g}" for r in args.rate]
    if not loads:
        parser.error("give at least one --concurrency or --rate")
    workload = (locomo_workload(args.locomo, args.users, args.facts_per_user) if args.locomo
                else synthetic_workload(args.users, args.facts_per_user, args.fact_clauses))
    label = (f"{args.shape} shape, DUMMY weights, SYNTHETIC fact KV ({args.kv_dtype})" if synthetic
             else f"{tokenizer_dir.name}, {args.kv_dtype}") + f"; {workload.source}, {args.users} users"
    args.output.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    phases: dict[str, dict | None] = {}

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        (args.output / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "model": label, "synthetic_kv": synthetic,
            "results": results, "connector_phases": phases}, indent=2))

    rng = random.Random(5)
    with tempfile.TemporaryDirectory(prefix="inferscale-serve-") as workdir:
        work = Path(workdir)
        model_dir = (build_dummy_model(work / args.shape, args.shape, tokenizer_dir, args.kv_dtype) if synthetic
                     else tokenizer_dir)
        stats_path = work / "loads.jsonl"
        service = MemoryServiceProcess(work / "data", work / "memory_service.log",
                                       *args.service_flags.split()).start()
        node = None
        try:
            with service.channel() as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                ingest(stub, workload)
                worker_module = "benchmarks.synthetic_worker" if synthetic else "precompute_worker"
                worker = subprocess.Popen([sys.executable, "-m", worker_module, "--memory-service", service.address,
                                           "--model", str(model_dir), "--dtype", args.kv_dtype, "--exit-when-idle"],
                                          stdout=subprocess.DEVNULL, stderr=(work / "worker.log").open("wb"))
                wait_for_kv(stub, sum(len(facts) for facts in workload.facts.values()), worker)
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
            warm_up(client, str(model_dir), workload, args.facts_per_user, args.max_tokens)
            stats_path.unlink(missing_ok=True)
            total = len(loads) * len(MODES) * len(args.k) * args.requests
            with tqdm(total=total, desc="requests", unit="req") as progress:
                for load in loads:
                    for k in args.k:
                        jobs = workload.jobs(args.requests, rng)
                        for mode in MODES:  # contenders interleaved per k, same questions, in one run
                            row = run_mode(client, str(model_dir), jobs, mode, k, load, args.max_tokens, node.base_url)
                            results.setdefault(load, {m: {} for m in MODES})[mode][str(k)] = row
                            progress.update(len(jobs))
                            save()
            phases.update({str(k): connector_phases(stats_path, k + 1) for k in args.k} if args.load_stats else {})
            save()
        finally:
            if node is not None:
                node.stop()
            service.stop()

    plots = plot(results, args.output, label)
    for load in loads:
        report(results[load], args.k, f"{label}, {describe(load)}")
    for k, row in phases.items():
        if row:
            print(f"connector per warm load, k={k} ({row['tokens_p50']:.0f} tokens, {row['loads']} loads): "
                  f"{row['ms_p50']:.2f} ms p50 = staging {row['stage_ms_p50']:.2f} + compose "
                  f"{row['compose_ms_p50']:.2f} + cache writes {row['write_ms_p50']:.2f}")
    print(f"\nJSON: {args.output / 'results.json'}   plots: {'  '.join(str(p) for p in plots)}")


def warm_up(client, model: str, workload: Workload, facts_per_user: int, max_tokens: int) -> None:
    """Compiles the engine's paths and brings every fact of every user into the node cache once."""
    jobs = [(user, mode) for user in workload.users for mode in MODES]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(tqdm(pool.map(lambda job: one_request(client, model, job[0], "warm up", job[1], facts_per_user,
                                                   max_tokens), jobs), total=len(jobs), desc="warm-up", unit="req"))


def describe(load: str) -> str:
    return f"closed loop, {load[1:]} in flight" if load.startswith("c") else f"open loop, {load[1:]} requests/s"


def ratio(kv: float, text: float) -> str:
    return f"{kv / text:.2f}" if text and not math.isnan(text) and not math.isnan(kv) else "n/a"


def report(results: dict, ks: list[int], title: str) -> None:
    """Blocks in `vllm bench serve`'s layout, one per k, each contender's lines side by side, then kv/text ratios."""
    print(f"\n{'=' * 20} InferScale Serving Benchmark Result {'=' * 20}\n{title}")
    metric_rows = [("Request throughput (req/s)", lambda r: r["throughput_rps"], "{:.2f}"),
                   ("Mean prompt tokens", lambda r: r["mean_prompt_tokens"], "{:.0f}"),
                   ("Mean cached prompt tokens", lambda r: r["mean_injected_tokens"], "{:.0f}"),
                   ("Node-cache hit rate", lambda r: r["node_cache_hit_rate"], "{:.2f}")]
    for k in ks:
        rows = {mode: results[mode][str(k)] for mode in MODES}
        print(f"{'-' * 22} k = {k} facts ({rows['kv']['requests']} requests each) {'-' * 22}")
        print(f"{'':<34}" + "".join(f"{mode:>12}" for mode in MODES))
        for name, value, fmt in metric_rows:
            print(f"{name:<34}" + "".join(f"{'' if value(r) is None else fmt.format(value(r)):>12}"
                                          for r in rows.values()))
        for heading, metric, points in (("Query-to-first-token (ms)", "query_to_first_token_ms", ("p50", "p90", "p99")),
                                        ("TTFT after the memory step (ms)", "ttft_ms", ("p50", "p90", "p99")),
                                        ("Engine TTFT, vLLM (ms)", "engine_ttft_ms", ("mean",)),
                                        ("TPOT (ms)", "tpot_ms", ("p50", "p99"))):
            for point in points:
                print(f"{heading.replace(' (ms)', f' {point} (ms)'):<34}"
                      + "".join(f"{rows[mode][metric][point]:>12.1f}" for mode in MODES))
        kv, text = rows["kv"], rows["text"]
        print(f"kv/text: query-to-first-token p50 "
              f"{ratio(kv['query_to_first_token_ms']['p50'], text['query_to_first_token_ms']['p50'])}, "
              f"TTFT p50 {ratio(kv['ttft_ms']['p50'], text['ttft_ms']['p50'])}, engine TTFT (vLLM mean) "
              f"{ratio(kv['engine_ttft_ms']['mean'], text['engine_ttft_ms']['mean'])}, throughput "
              f"{ratio(kv['throughput_rps'], text['throughput_rps'])}x")
    print("=" * 78)


if __name__ == "__main__":
    main()
