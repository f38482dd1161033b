"""Serving benchmark: memory as KV against the best text deployment and no memory, side by side in one run, through
the OpenAI API.

    python -m benchmarks.serve [--workloads synthetic varying long cold] [--k 10 50] [--tails 1 2 5 10]
    python -m benchmarks.serve --locomo ../shared/data/locomo/locomo-dev6.json      # LoCoMo facts and questions
    python -m benchmarks.serve --shape llama3-8b --kv-dtype bfloat16 --node-flags "..."     # GPU speed run

Contenders (each request's `memory` field; same users, same questions, interleaved per k):
- kv: the retrieved facts' KV injected (best fact last), all of them (whatever the node's default tail);
- text: the same facts as text in the same prompt, vLLM prefix caching on;
- text-stable: the same facts as text in a stable per-user order (creation order), so that a user's consecutive
  prompts share their longest common prefix and vLLM's prefix cache reuses it: the best text deployment;
- off: no memory (the floor);
- kv-auto (--kv-auto): kv under the node's crossover policy (memories shorter than its crossover served as text;
  `kv` always injects);
- kv-tail<m> (--tails): kv with the m facts nearest the question prefilled as text (--recompute-tail-facts).
Workloads, each on its own memory service, worker and node (--workloads):
- synthetic: --users users x --facts-per-user synthetic facts, k from --k (or LoCoMo observations with --locomo);
- varying: k of 10, 20, 50 out of --varying-facts facts per user, so consecutive requests share only part of their
  facts (LoCoMo: every observation of a conversation);
- long: k=50 facts of --long-clauses clauses each, thousands of memory tokens per request;
- cold: --cold-users users' KV against a node cache that holds about two users' facts, so kv loads miss and take
  the async path; kv-warm asks the same of two users whose KV the node cache holds: the difference is a miss's cost.
Per (workload, load, k, contender): query-to-first-token (client clock: retrieval + staging + compose + engine),
TTFT (that minus the node's RetrieveAndStage), vLLM's engine TTFT (its histogram's mean) split into vLLM's queue
time (arrival to first scheduled: an async KV load's round trip lands here) and prefill time (first scheduled to first
token) with each contender's difference to off, TPOT, throughput, prompt
and cached tokens, the node-cache hit rate (kv) and vLLM's prefix-cache hit rate (all), with kv/text and
kv/text-stable ratios; with --load-stats also the connector's own time per warm load. Writes results.json (after
every measurement) and PNGs per workload. `--shape llama3-8b` serves a Llama-3-8B-shaped model with DUMMY weights
and SYNTHETIC fact KV (random, uploaded by the real worker pipeline); every report of such a run says so.
`--nodes N --routing consistent-hash round-robin` runs the fleet mode instead (benchmarks/fleet.py): N nodes behind
vLLM's router, kv requests of the synthetic workload's users, the node-cache hit rate and requests per node.
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
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from benchmarks.dummy_model import SHAPES, build_dummy_model
from benchmarks.locomo_data import load_locomo
from benchmarks.stats import percentiles_ms
from benchmarks.synthetic import synthetic_facts, synthetic_queries
from demo.smollm2 import build_smollm2
from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from harness.router import ROUTINGS
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from precompute_worker.progress import wait_for_kv

# contender -> the request's memory field beside user_id and top_k
CONTENDERS: dict[str, dict] = {"kv": {"mode": "kv", "recompute_tail_facts": 0, "kv_crossover_tokens": 0},
                               "text": {"mode": "text"}, "text-stable": {"mode": "text", "order": "created"},
                               "off": {"mode": "off"}}
# --kv-auto: kv as the node serves it by default, text below the node's crossover (inference_node.crossover)
KV_AUTO = {"mode": "kv", "recompute_tail_facts": 0}
WORKLOADS = ("synthetic", "varying", "long", "cold")
WARM_USERS = 2  # the cold workload's kv-warm contender: users whose KV the node cache holds


def tail_contender(m: int) -> str:
    return f"kv-tail{m}"


@dataclass
class Sample:
    contender: str
    k: int
    query_to_first_token_s: float
    ttft_s: float  # query-to-first-token minus the node's memory step (RetrieveAndStage)
    tpot_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int  # injected by the connector or reused from vLLM's prefix cache


def one_request(client, model: str, user: str, question: str, memory: dict, k: int, max_tokens: int,
                contender: str = "") -> Sample:
    started = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"memory": {"user_id": user, "top_k": k, **memory}, "ignore_eos": True},
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
    return Sample(contender, k, first - started, first - started - stage_s,
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
        "mean_cached_tokens": sum(s.cached_tokens for s in samples) / len(samples),
    }


@dataclass(frozen=True)
class Workload:
    """Per simulated user: the facts to ingest (and turns, for LoCoMo), and the questions they ask."""

    users: list[str]
    facts: dict[str, list[pb.FactInput]]
    turns: dict[str, list[pb.Turn]]
    questions: dict[str, list[str]]
    source: str

    def jobs(self, count: int, rng: random.Random, users: list[str] | None = None) -> list[tuple[str, str]]:
        """`count` (user, question) pairs, users round-robin, each user's questions in a shuffled order without
        repeats until they run out (a repeat would find its whole prompt in vLLM's prefix cache)."""
        users = users or self.users
        queues: dict[str, list[str]] = {user: [] for user in users}
        jobs = []
        for user in itertools.islice(itertools.cycle(users), count):
            if not queues[user]:
                queues[user] = rng.sample(self.questions[user], len(self.questions[user]))
            jobs.append((user, queues[user].pop()))
        return jobs

    def warm_up_questions(self, user: str, count: int, seed: int) -> list[str]:
        """Questions none of the user's measured ones: they bring the user's facts into the node cache without
        putting a measured prompt into vLLM's prefix cache."""
        asked = set(self.questions[user])
        return [q for q in synthetic_queries(count * 4 + 8, seed) if q not in asked][:count]


def synthetic_workload(users: int, facts_per_user: int, clauses: int, prefix: str = "bench-user") -> Workload:
    names = [f"{prefix}-{i}" for i in range(users)]
    return Workload(
        names, {user: [pb.FactInput(text=t) for t in synthetic_facts(facts_per_user, 1000 + n, clauses)]
                for n, user in enumerate(names)},
        {}, {user: synthetic_queries(32, seed=5 + n) for n, user in enumerate(names)},
        f"synthetic facts ({clauses} clause(s) each)")


def locomo_workload(path: Path, users: int, facts_per_user: int | None) -> Workload:
    """User i replays LoCoMo conversation i mod 6 (its first `facts_per_user` observations, all when None, and its
    questions)."""
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


@dataclass(frozen=True)
class WorkloadPlan:
    """One workload of the run: its memories, the k it sweeps, and what its node needs."""

    name: str
    workload: Workload
    ks: list[int]
    node_flags: list[str] = field(default_factory=list)  # after --node-flags: these win
    warm_node_cache: bool = True
    warm_users: list[str] = field(default_factory=list)  # cold: the kv-warm contender's users


def plan_workloads(args: argparse.Namespace) -> list[WorkloadPlan]:
    plans = []
    for name in args.workloads:
        if name == "synthetic":
            workload = (locomo_workload(args.locomo, args.users, args.facts_per_user) if args.locomo
                        else synthetic_workload(args.users, args.facts_per_user, args.fact_clauses))
            plans.append(WorkloadPlan(name, workload, args.k))
        elif name == "varying":
            workload = (locomo_workload(args.locomo, args.users, None) if args.locomo
                        else synthetic_workload(args.users, args.varying_facts, args.fact_clauses, "varying-user"))
            plans.append(WorkloadPlan(name, workload, args.varying_k))
        elif name == "long":
            workload = synthetic_workload(args.long_users, args.facts_per_user, args.long_clauses, "long-user")
            plans.append(WorkloadPlan(name, workload, [args.long_k], ["--max-model-len", str(args.long_max_model_len)]))
        else:
            workload = synthetic_workload(args.cold_users, args.facts_per_user, args.fact_clauses, "cold-user")
            plans.append(WorkloadPlan(name, workload, [args.cold_k], warm_node_cache=False,
                                      warm_users=workload.users[:WARM_USERS]))
    return plans


def cold_node_cache_mb(model_dir: Path, kv_dtype: str, workload: Workload, users: int) -> int:
    """A node cache 1.5x the KV of `users` users' facts (this model's shape and dtype): the cold workload's other
    users do not fit."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from inferscale_kv.layout import fact_token_ids
    from inferscale_kv.shape import KvShape

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    shape = KvShape.from_config(AutoConfig.from_pretrained(model_dir))
    itemsize = torch.empty(0, dtype=getattr(torch, kv_dtype if kv_dtype != "fp8_e4m3" else "float32")).element_size()
    tokens = sum(len(fact_token_ids(tokenizer, fact.text)) for user in workload.users[:users]
                 for fact in workload.facts[user])
    return max(1, math.ceil(1.5 * tokens * shape.elements_per_token() * itemsize / (1 << 20)))


def ingest(stub, workload: Workload) -> None:
    for user in tqdm(workload.users, desc="ingesting users", unit="user"):
        if workload.turns.get(user):
            stub.IngestTurns(pb.IngestTurnsRequest(user_id=user, turns=workload.turns[user]))
        facts = workload.facts[user]
        for begin in range(0, len(facts), 100):
            stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=facts[begin : begin + 100]))


def plot(results: dict, contenders: list[str], output: Path, title: str) -> list[Path]:
    """TTFT vs k at the first load; throughput vs concurrent users at each k (when several concurrencies ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    first = results[next(iter(results))]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for contender in contenders:
        ks = sorted(int(k) for k in first[contender])
        for axis, metric in zip(axes, ("query_to_first_token_ms", "engine_ttft_ms"), strict=True):
            axis.plot(ks, [first[contender][str(k)][metric]["p50" if metric != "engine_ttft_ms" else "mean"]
                           for k in ks], marker="o", label=contender)
    axes[0].set_ylabel("query-to-first-token p50 (ms)")
    axes[1].set_ylabel("engine TTFT, vLLM mean (ms)")
    for axis in axes:
        axis.set_xlabel("facts retrieved (k)")
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    figure.suptitle(f"InferScale, {describe(next(iter(results)))}: {title}", fontsize=9)
    figure.tight_layout()
    paths.append(output / "ttft_vs_k.png")
    figure.savefig(paths[-1], dpi=120)
    closed = sorted((int(load[1:]), load) for load in results if load.startswith("c"))
    if len(closed) > 1:
        figure, axis = plt.subplots(figsize=(6, 4))
        for contender in contenders:
            for k in first[contender]:
                axis.plot([c for c, _ in closed], [results[load][contender][k]["throughput_rps"] for _, load in closed],
                          marker="o", label=f"{contender}, k={k}")
        axis.set_xlabel("concurrent users")
        axis.set_ylabel("requests / s")
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        paths.append(output / "throughput_vs_users.png")
        figure.savefig(paths[-1], dpi=120)
    return paths


_VLLM_COUNTERS = {"vllm:prefix_cache_queries_total": "prefix_cache_queries",
                  "vllm:prefix_cache_hits_total": "prefix_cache_hits"}
_VLLM_HISTOGRAMS = {"vllm:time_to_first_token_seconds": "ttft", "vllm:request_queue_time_seconds": "queue",
                    "vllm:request_prefill_time_seconds": "prefill"}


def parse_counters(metrics_text: str) -> dict[str, float]:
    """The connector counters (inferscale_connector_*_total), vLLM's prefix-cache counters and the sum/count of its
    TTFT, queue-time and prefill-time histograms, summed over label sets."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name = None
        metric = line.split("{")[0].split(" ")[0]
        if line.startswith("inferscale_connector_") and "_total{" in line:
            name = line[len("inferscale_connector_") : line.index("_total{")]
        elif metric.endswith(("_sum", "_count")) and metric.rsplit("_", 1)[0] in _VLLM_HISTOGRAMS:
            histogram, part = metric.rsplit("_", 1)
            name = f"{_VLLM_HISTOGRAMS[histogram]}_{part}"
        elif metric in _VLLM_COUNTERS:
            name = _VLLM_COUNTERS[metric]
        if name:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def node_counters(base_url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return parse_counters(response.read().decode())


def engine_ttft_ms(before: dict[str, float], after: dict[str, float], histogram: str = "ttft") -> dict[str, float]:
    """vLLM's own TTFT (or another of _VLLM_HISTOGRAMS) over a run, from its histogram's sum and count (mean;
    percentiles need the buckets)."""
    count = after.get(f"{histogram}_count", 0.0) - before.get(f"{histogram}_count", 0.0)
    mean = ((after.get(f"{histogram}_sum", 0.0) - before.get(f"{histogram}_sum", 0.0)) / count * 1000 if count
            else float("nan"))
    return {"mean": mean, "requests": count}


def counter_ratio(before: dict[str, float], after: dict[str, float], hits: str, lookups: str) -> float | None:
    """hits / lookups over a run, from two counters' deltas (None without lookups)."""
    total = after.get(lookups, 0.0) - before.get(lookups, 0.0)
    return (after.get(hits, 0.0) - before.get(hits, 0.0)) / total if total else None


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    return counter_ratio(before, after, "node_cache_hits", "node_cache_lookups")


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


def run_contender(client, model: str, jobs: list[tuple[str, str]], contender: str, memory: dict, k: int, load: str,
                  max_tokens: int, base_url: str) -> dict:
    """One contender at one load: "c<N>" = closed loop with N in flight, "r<R>" = open loop at R requests/s."""
    before = node_counters(base_url)

    def ask(job: tuple[str, str]) -> Sample:
        return one_request(client, model, job[0], job[1], memory, k, max_tokens, contender)

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
    row["engine_queue_ms"] = engine_ttft_ms(before, after, "queue")
    row["engine_prefill_ms"] = engine_ttft_ms(before, after, "prefill")
    row["node_cache_hit_rate"] = hit_rate(before, after) if memory["mode"] == "kv" else None
    row["prefix_cache_hit_rate"] = counter_ratio(before, after, "prefix_cache_hits", "prefix_cache_queries")
    row["facts_fetched_per_request"] = (after.get("facts_fetched", 0.0) - before.get("facts_fetched", 0.0)) / len(jobs)
    return row


def warm_up(client, model: str, plan: WorkloadPlan, users: list[str], max_tokens: int, node_cache: bool,
            compile_paths: bool = True) -> None:
    """Compiles the engine's paths (every contender once) and, with `node_cache`, brings the users' facts into the
    node cache with questions that are not measured."""
    k = max(plan.ks)
    facts = max(len(plan.workload.facts[user]) for user in users)
    rounds = 2 * math.ceil(facts / k) if node_cache else 0
    jobs = [(users[0], "warm up", memory) for memory in CONTENDERS.values()] if compile_paths else []
    jobs += [(user, question, CONTENDERS["kv"]) for n, user in enumerate(users)
             for question in plan.workload.warm_up_questions(user, rounds, seed=900 + n)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(tqdm(pool.map(lambda job: one_request(client, model, job[0], job[1], job[2], k, max_tokens), jobs),
                  total=len(jobs), desc="warm-up", unit="req"))


def run_workload(plan: WorkloadPlan, args: argparse.Namespace, tokenizer_dir: Path, loads: list[str],
                 contenders: dict[str, dict], work: Path, on_result) -> dict:
    """Starts a memory service, a worker and a node for one workload and measures every contender on it."""
    synthetic = args.shape is not None
    model_dir = (build_dummy_model(work / args.shape, args.shape, tokenizer_dir, args.kv_dtype) if synthetic
                 else tokenizer_dir)
    stats_path = work / "loads.jsonl"
    node_flags = [*args.node_flags.split(), "--kv-dtype", args.kv_dtype, *plan.node_flags]
    if synthetic:
        node_flags += ["--load-format", "dummy"]
    if args.load_stats:
        node_flags += ["--load-stats-path", str(stats_path)]
    cache_mb = None
    if plan.warm_users:
        cache_mb = cold_node_cache_mb(model_dir, args.kv_dtype, plan.workload, len(plan.warm_users))
        node_flags += ["--node-cache-mb", str(cache_mb)]
    outcome: dict = {"results": {}, "node_cache_mb": cache_mb, "source": plan.workload.source}
    service = MemoryServiceProcess(work / "data", work / "memory_service.log", *args.service_flags.split()).start()
    node = None
    try:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            ingest(stub, plan.workload)
            worker_module = "benchmarks.synthetic_worker" if synthetic else "precompute_worker"
            worker = subprocess.Popen([sys.executable, "-m", worker_module, "--memory-service", service.address,
                                       "--model", str(model_dir), "--dtype", args.kv_dtype, "--exit-when-idle"],
                                      stdout=subprocess.DEVNULL, stderr=(work / "worker.log").open("wb"))
            wait_for_kv(stub, sum(len(facts) for facts in plan.workload.facts.values()), worker)
            worker.wait(timeout=600)
        print(f"starting the inference node for the {plan.name} workload ...", flush=True)
        node = InferenceNodeProcess(service.address, model_dir, work / "node", *node_flags).start()
        from openai import OpenAI

        client = OpenAI(base_url=f"{node.base_url}/v1", api_key="bench", timeout=600)
        warm_up(client, str(model_dir), plan, plan.workload.users, args.max_tokens, plan.warm_node_cache)
        stats_path.unlink(missing_ok=True)
        rng = random.Random(5)
        names = [*contenders, *(["kv-warm"] if plan.warm_users else [])]
        with tqdm(total=len(loads) * len(names) * len(plan.ks) * args.requests, desc=f"{plan.name} requests",
                  unit="req") as progress:
            for load in loads:
                for k in plan.ks:
                    jobs = plan.workload.jobs(args.requests, rng)
                    for contender, memory in contenders.items():  # same questions, one after the other
                        row = run_contender(client, str(model_dir), jobs, contender, memory, k, load,
                                            args.max_tokens, node.base_url)
                        outcome["results"].setdefault(load, {})
                        outcome["results"][load].setdefault(contender, {})[str(k)] = row
                        progress.update(len(jobs))
                        on_result()
                    if plan.warm_users:  # the same requests' shape, against users whose KV the node cache holds
                        warm_up(client, str(model_dir), plan, plan.warm_users, args.max_tokens, node_cache=True,
                                compile_paths=False)
                        warm_jobs = plan.workload.jobs(args.requests, rng, plan.warm_users)
                        row = run_contender(client, str(model_dir), warm_jobs, "kv-warm", CONTENDERS["kv"], k, load,
                                            args.max_tokens, node.base_url)
                        outcome["results"][load].setdefault("kv-warm", {})[str(k)] = row
                        progress.update(len(warm_jobs))
                        on_result()
        if args.load_stats:
            outcome["connector_phases"] = {str(k): connector_phases(stats_path, k + 1) for k in plan.ks}
    finally:
        if node is not None:
            node.stop()
        service.stop()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["synthetic"])
    parser.add_argument("--k", type=int, nargs="+", default=[5, 10, 20, 50], help="the synthetic workload's k")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--facts-per-user", type=int, default=60)
    parser.add_argument("--fact-clauses", type=int, default=1, help="synthetic facts: ~17 tokens per clause")
    parser.add_argument("--locomo", type=Path, default=None, help="LoCoMo JSON: its observations and questions")
    parser.add_argument("--varying-facts", type=int, default=300, help="varying: facts per user (synthetic)")
    parser.add_argument("--varying-k", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument("--long-users", type=int, default=2)
    parser.add_argument("--long-clauses", type=int, default=8, help="long: clauses per fact (~136 tokens at 8)")
    parser.add_argument("--long-k", type=int, default=50)
    parser.add_argument("--long-max-model-len", type=int, default=8192)
    parser.add_argument("--cold-users", type=int, default=16)
    parser.add_argument("--cold-k", type=int, default=20)
    parser.add_argument("--tails", type=int, nargs="*", default=[1, 2, 5, 10],
                        help="kv-tail<m> contenders: the m facts nearest the question prefilled as text")
    parser.add_argument("--kv-auto", action="store_true",
                        help="also measure kv-auto: kv under the node's crossover policy (kv always injects)")
    parser.add_argument("--requests", type=int, default=8, help="requests per (load, k, contender)")
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
    parser.add_argument("--nodes", type=int, default=0,
                        help="fleet mode: this many nodes behind vLLM's router, kv only, synthetic workload "
                        "(benchmarks/fleet.py)")
    parser.add_argument("--routing", nargs="+", choices=sorted(ROUTINGS), default=["consistent-hash"],
                        help="fleet mode: the router's policies, one after the other on the same nodes")
    args = parser.parse_args()

    tokenizer_dir = (args.model or build_smollm2()).resolve()
    loads = [f"c{c}" for c in args.concurrency] + [f"r{r:g}" for r in args.rate]
    if not loads:
        parser.error("give at least one --concurrency or --rate")
    if args.nodes:
        from benchmarks.fleet import run_fleet

        run_fleet(args, tokenizer_dir, loads)
        return
    tails = {tail_contender(m): {**CONTENDERS["kv"], "recompute_tail_facts": m} for m in args.tails}
    contenders = {**CONTENDERS, **({"kv-auto": KV_AUTO} if args.kv_auto else {}), **tails}
    model_label = (f"{args.shape} shape, DUMMY weights, SYNTHETIC fact KV ({args.kv_dtype})" if args.shape
                   else f"{tokenizer_dir.name}, {args.kv_dtype}")
    args.output.mkdir(parents=True, exist_ok=True)
    workloads: dict[str, dict] = {}

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        (args.output / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "model": model_label,
            "synthetic_kv": args.shape is not None, "workloads": workloads}, indent=2))

    for plan in plan_workloads(args):
        label = f"{model_label}; {plan.name} workload: {plan.workload.source}, {len(plan.workload.users)} users"
        with tempfile.TemporaryDirectory(prefix=f"inferscale-serve-{plan.name}-") as workdir:
            workloads[plan.name] = {"label": label}
            workloads[plan.name].update(run_workload(plan, args, tokenizer_dir, loads, contenders, Path(workdir),
                                                     save))
        save()
    for name, outcome in workloads.items():
        results = outcome["results"]
        plot_dir = args.output / name
        plot_dir.mkdir(parents=True, exist_ok=True)
        outcome["plots"] = [str(p) for p in plot(results, list(results[loads[0]]), plot_dir, outcome["label"])]
        for load in loads:
            report(results[load], f"{outcome['label']}, {describe(load)}", outcome.get("node_cache_mb"))
        for k, row in (outcome.get("connector_phases") or {}).items():
            if row:
                print(f"connector per warm load, k={k} ({row['tokens_p50']:.0f} tokens, {row['loads']} loads): "
                      f"{row['ms_p50']:.2f} ms p50 = staging {row['stage_ms_p50']:.2f} + compose "
                      f"{row['compose_ms_p50']:.2f} + cache writes {row['write_ms_p50']:.2f}")
    save()
    print(f"\nJSON: {args.output / 'results.json'}   plots under {args.output}/<workload>/")


def engine_breakdown(row: dict, off: dict) -> str:
    """Where a contender's engine TTFT goes beyond the no-memory floor: vLLM's queue time (arrival to first scheduled,
    which holds an async KV load's round trip), prefill time (the first forward: attention over the memory, the
    connector's in-step work) and the rest (detokenizing, the engine's output path)."""
    parts = {metric: row[metric]["mean"] - off[metric]["mean"]
             for metric in ("engine_ttft_ms", "engine_queue_ms", "engine_prefill_ms")}
    rest = parts["engine_ttft_ms"] - parts["engine_queue_ms"] - parts["engine_prefill_ms"]
    return (f"engine TTFT {parts['engine_ttft_ms']:+.1f} ms = queue {parts['engine_queue_ms']:+.1f} + prefill "
            f"{parts['engine_prefill_ms']:+.1f} + rest {rest:+.1f}")


def describe(load: str) -> str:
    return f"closed loop, {load[1:]} in flight" if load.startswith("c") else f"open loop, {load[1:]} requests/s"


def ratio(kv: float, text: float) -> str:
    return f"{kv / text:.2f}" if text and not math.isnan(text) and not math.isnan(kv) else "n/a"


def _fmt(value, spec: str) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else spec.format(value)


def report(results: dict, title: str, node_cache_mb: int | None = None) -> None:
    """Blocks in `vllm bench serve`'s layout, one per k, each contender's lines side by side, then kv's ratios to
    text and to text-stable, each tail's TTFT cost over kv, and (cold workload) what a node-cache miss costs."""
    names = list(results)
    print(f"\n{'=' * 20} InferScale Serving Benchmark Result {'=' * 20}\n{title}")
    metric_rows = [("Request throughput (req/s)", lambda r: r["throughput_rps"], "{:.2f}"),
                   ("Mean prompt tokens", lambda r: r["mean_prompt_tokens"], "{:.0f}"),
                   ("Mean cached prompt tokens", lambda r: r["mean_cached_tokens"], "{:.0f}"),
                   ("Node-cache hit rate", lambda r: r["node_cache_hit_rate"], "{:.2f}"),
                   ("Prefix-cache hit rate (vLLM)", lambda r: r.get("prefix_cache_hit_rate"), "{:.2f}"),
                   ("Facts fetched per request", lambda r: r.get("facts_fetched_per_request"), "{:.1f}")]
    width = max(12, max(len(name) for name in names) + 2)
    for k in next(iter(results.values())):
        rows = {name: results[name][k] for name in names if k in results[name]}
        print(f"{'-' * 22} k = {k} facts ({rows['kv']['requests']} requests each) {'-' * 22}")
        print(f"{'':<34}" + "".join(f"{name:>{width}}" for name in rows))
        for label, value, spec in metric_rows:
            print(f"{label:<34}" + "".join(f"{_fmt(value(r), spec):>{width}}" for r in rows.values()))
        for heading, metric, points in (("Query-to-first-token (ms)", "query_to_first_token_ms", ("p50", "p90", "p99")),
                                        ("TTFT after the memory step (ms)", "ttft_ms", ("p50", "p90", "p99")),
                                        ("Engine TTFT, vLLM (ms)", "engine_ttft_ms", ("mean",)),
                                        ("Engine queue time, vLLM (ms)", "engine_queue_ms", ("mean",)),
                                        ("Engine prefill time, vLLM (ms)", "engine_prefill_ms", ("mean",)),
                                        ("TPOT (ms)", "tpot_ms", ("p50", "p99"))):
            for point in points:
                print(f"{heading.replace(' (ms)', f' {point} (ms)'):<34}"
                      + "".join(f"{_fmt(r[metric][point] if metric in r else None, '{:.1f}'):>{width}}"
                                for r in rows.values()))
        kv = rows["kv"]
        for baseline in ("text", "text-stable"):
            if baseline in rows:
                other = rows[baseline]
                print(f"kv/{baseline}: query-to-first-token p50 "
                      f"{ratio(kv['query_to_first_token_ms']['p50'], other['query_to_first_token_ms']['p50'])}, "
                      f"TTFT p50 {ratio(kv['ttft_ms']['p50'], other['ttft_ms']['p50'])}, engine TTFT (vLLM mean) "
                      f"{ratio(kv['engine_ttft_ms']['mean'], other['engine_ttft_ms']['mean'])}, throughput "
                      f"{ratio(kv['throughput_rps'], other['throughput_rps'])}x")
        if "off" in rows:
            for name, row in rows.items():
                if name != "off" and "engine_queue_ms" in row:
                    print(f"{name} - off: {engine_breakdown(row, rows['off'])}")
        for name, row in rows.items():
            if name.startswith("kv-tail"):
                cost = row["engine_ttft_ms"]["mean"] / kv["engine_ttft_ms"]["mean"] - 1
                print(f"{name}: engine TTFT {_fmt(row['engine_ttft_ms']['mean'], '{:.1f}')} ms, "
                      f"{_fmt(100 * cost, '{:+.1f}')}% over kv")
        if "kv-warm" in rows:
            warm, miss_rate = rows["kv-warm"], 1 - (kv["node_cache_hit_rate"] or 0.0)
            extra = kv["query_to_first_token_ms"]["p50"] - warm["query_to_first_token_ms"]["p50"]
            fetched = kv.get("facts_fetched_per_request") or 0.0
            print(f"cold node cache ({node_cache_mb} MiB): miss rate {miss_rate:.2f}, "
                  f"{fetched:.1f} facts fetched per request; query-to-first-token p50 {extra:+.1f} ms against the "
                  f"warm users" + (f" ({extra / fetched:.2f} ms per fetched fact)" if fetched else ""))
    print("=" * 78)


if __name__ == "__main__":
    main()
