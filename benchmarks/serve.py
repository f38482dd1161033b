"""Serving benchmark: memory as KV against the best text deployment and no memory, side by side in one run, through
the OpenAI API.

    python -m benchmarks.serve [--workloads synthetic varying long cold] [--k 10 50] [--tails 1 2 5 10]
    python -m benchmarks.serve --locomo ../shared/data/locomo/locomo-dev6.json      # LoCoMo facts and questions
    python -m benchmarks.serve --shape llama3-8b --kv-dtype bfloat16 --node-flags "..."     # GPU speed run
    python -m benchmarks.serve --prepare STATE [workload flags]   # servers up, memories in and warm; left running
    python -m benchmarks.serve --attach STATE [measurement flags] # measure against them (benchmarks/device_run.sh)
    python -m benchmarks.serve --stop STATE

Contenders (each request's `memory` field; same users, same questions, interleaved per k):
- kv: the retrieved facts' KV injected (best fact last), all of them (whatever the node's default tail);
- text: the same facts as text in the same prompt, vLLM prefix caching on;
- text-stable: the same facts as text in a stable per-user order (creation order), so that a user's consecutive
  prompts share their longest common prefix and vLLM's prefix cache reuses it: the best text deployment;
- off: no memory (the floor);
- kv-auto (--kv-auto): kv under the node's crossover policy (memories shorter than its crossover served as text;
  `kv` always injects);
- kv-tail<m> (--tails): kv with the m facts nearest the question prefilled as text (--recompute-tail-facts).
A contender that could send the very request another sends (same prompt, same cache salt: kv-auto is kv above the
node's crossover and text below it; kv-warm is kv) asks for users of its own with the same memories, so that no
contender finds another's blocks in vLLM's prefix cache (`isolation_namespaces`).
Workloads, each on its own memory service, worker and node (--workloads; with --prepare, all on one):
- synthetic: --users users x --facts-per-user synthetic facts, k from --k (or LoCoMo observations with --locomo);
- varying: k of 10, 20, 50 out of --varying-facts facts per user, so consecutive requests share only part of their
  facts (LoCoMo: every observation of a conversation);
- long: k=50 facts of --long-clauses clauses each, thousands of memory tokens per request;
- cold: --cold-users users' KV against a node cache whose device tier holds about two users' facts (its host tier at
  the node's default). Every load asks users the node has never seen, --requests of them each (so --cold-users must
  be at least --requests x the loads): kv and kv-auto (its own copies of those users) are fully cold, their KV only
  in the memory service's tiers; text, text-stable and off ask the same questions; kv-warm asks two users whose KV
  the device tier holds; kv-host asks users of its own touched once (whole memory) just before, whose KV the host
  tier holds and the device tier no longer does; kv-second asks kv's users a second, other question (other facts at
  k < facts), after their first request had the node warm their other facts into its host tier. Between contenders
  the run waits for the node's background fetches to settle, so each contender's connector counters are its own.
Per (workload, load, k, contender): query-to-first-token (client clock: retrieval + staging + compose + engine),
TTFT (that minus the node's RetrieveAndStage), vLLM's engine TTFT (its histogram's mean) split into vLLM's queue
time (arrival to first scheduled: a wait for a prefetch lands here) and prefill time (first scheduled to first token)
with each contender's difference to off, TPOT, throughput, prompt and cached tokens, the node-cache hit rate (kv) and
vLLM's prefix-cache hit rate (all), with kv/text and kv/text-stable ratios; the connector counters' deltas (loads,
partial and async loads, load failures, host-tier hits, facts fetched, warmed chunks) and the byte path's bandwidth
as the node measured it (service fetch and host-to-device copy GB/s); with --load-stats also the connector's own
time per warm load. vLLM's engine TTFT p50 is interpolated from its histogram's buckets (coarse: a bucket's width).
Prints a line and rewrites results.json after every measurement (a run cut short keeps what it measured), and writes
PNGs per workload. `--shape llama3-8b` serves a Llama-3-8B-shaped model with DUMMY weights and
SYNTHETIC fact KV (random, uploaded by the real worker pipeline); every report of such a run says so.
`--nodes N --routing consistent-hash round-robin` runs the fleet mode instead (benchmarks/fleet.py): N nodes behind
vLLM's router, kv requests of the synthetic workload's users, the node-cache hit rate and requests per node.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tqdm import tqdm

from benchmarks.dummy_model import SHAPES, build_dummy_model
from benchmarks.fleet import run_fleet
from benchmarks.serve_requests import (
    CONTENDERS,
    Sample,
    Workload,
    describe,
    ingest,
    locomo_workload,
    one_request,
    run_load,
    summarize,
    synthetic_workload,
)
from benchmarks.serve_session import ServerProcess, Session, exclusive
from demo.smollm2 import build_smollm2
from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from harness.router import ROUTINGS
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc

# --kv-auto: kv as the node serves it by default, text below the node's crossover (inference_node.crossover)
KV_AUTO = {"mode": "kv", "recompute_tail_facts": 0}
WORKLOADS = ("synthetic", "varying", "long", "cold")
WARM_USERS = 2  # the cold workload's kv-warm contender: users whose KV the node cache holds
# Cold workload contenders beyond kv-warm: users whose KV is in the node's host tier only (touched just before), and
# kv's own users asked a second question (their memory warmed by their first request).
KV_HOST, KV_SECOND = "kv-host", "kv-second"
COLD_ONLY = ("kv-warm", KV_HOST, KV_SECOND)
# The connector counters each row reports as deltas (inferscale_connector_<name>_total on the node's /metrics).
CONNECTOR_DELTAS = ("loads", "async_loads", "partial_loads", "load_failures", "tokens_loaded", "node_cache_lookups",
                    "node_cache_hits", "facts_fetched", "durable_tier_reads", "host_tier_hits", "warmed_chunks",
                    "source_bytes_fetched", "source_fetch_micros", "host_bytes_copied", "host_copy_micros")


def tail_contender(m: int) -> str:
    return f"kv-tail{m}"


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
    """The connector counters (inferscale_connector_*_total), vLLM's prefix-cache counters, the sum/count of its
    TTFT, queue-time and prefill-time histograms and its TTFT histogram's cumulative buckets ("ttft_le:<bound>"),
    summed over label sets."""
    totals: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name = None
        metric = line.split("{")[0].split(" ")[0]
        if line.startswith("inferscale_connector_") and "_total{" in line:
            name = line[len("inferscale_connector_") : line.index("_total{")]
        elif metric == "vllm:time_to_first_token_seconds_bucket" and 'le="' in line:
            name = "ttft_le:" + line.split('le="', 1)[1].split('"', 1)[0]
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


def engine_ttft_ms(before: Mapping[str, float], after: Mapping[str, float],
                   histogram: str = "ttft") -> dict[str, float]:
    """vLLM's own TTFT (or another of _VLLM_HISTOGRAMS) over a run, from its histogram's sum and count (mean;
    percentiles need the buckets)."""
    count = after.get(f"{histogram}_count", 0.0) - before.get(f"{histogram}_count", 0.0)
    mean = ((after.get(f"{histogram}_sum", 0.0) - before.get(f"{histogram}_sum", 0.0)) / count * 1000 if count
            else float("nan"))
    return {"mean": mean, "requests": count}


def engine_ttft_percentile_ms(before: Mapping[str, float], after: Mapping[str, float], quantile: float = 0.5) -> float:
    """vLLM's TTFT at `quantile` over a run, interpolated linearly inside the bucket of its histogram's delta that
    holds it (as Prometheus' histogram_quantile does); NaN without requests, the last finite bound past it."""
    bounds = sorted((float(name.split(":", 1)[1]), name) for name in after if name.startswith("ttft_le:"))
    deltas = [(bound, after[name] - before.get(name, 0.0)) for bound, name in bounds]
    total = deltas[-1][1] if deltas else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = quantile * total, 0.0, 0.0
    for bound, cumulative in deltas:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower * 1000
            inside = cumulative - below
            return (lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)) * 1000
        lower, below = bound, cumulative
    return lower * 1000


def connector_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """The connector counters' changes over a run (CONNECTOR_DELTAS), with the bandwidths the node measured: the
    memory service's bytes over the time its fetches took (`source_gbps`, the byte path) and the host tier's bytes
    over the time its host-to-device copies took (`host_gbps`), None where nothing moved."""
    counts = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in CONNECTOR_DELTAS}
    deltas: dict[str, float | None] = dict(counts)
    for rate, (moved, micros) in (("source_gbps", ("source_bytes_fetched", "source_fetch_micros")),
                                  ("host_gbps", ("host_bytes_copied", "host_copy_micros"))):
        deltas[rate] = counts[moved] / counts[micros] / 1e3 if counts[micros] else None
    return deltas


def settle(base_url: str, quiet_s: float = 1.5, timeout_s: float = 120.0) -> float:
    """Waits until the node's background fetches (prefetches, a partial load's rest, warm-ups) have stopped: the
    chunks fetched and warmed unchanged for `quiet_s`. The seconds waited."""
    started = time.monotonic()
    watched = ("facts_fetched", "warmed_chunks", "host_tier_hits", "source_bytes_fetched")
    last = None
    while time.monotonic() - started < timeout_s:
        now = node_counters(base_url)
        current = tuple(now.get(name, 0.0) for name in watched)
        if current == last:
            break
        last = current
        time.sleep(quiet_s)
    return time.monotonic() - started


def counter_ratio(before: Mapping[str, float], after: Mapping[str, float], hits: str, lookups: str) -> float | None:
    """hits / lookups over a run, from two counters' deltas (None without lookups)."""
    total = after.get(lookups, 0.0) - before.get(lookups, 0.0)
    return (after.get(hits, 0.0) - before.get(hits, 0.0)) / total if total else None


def hit_rate(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    return counter_ratio(before, after, "node_cache_hits", "node_cache_lookups")


def connector_phases(stats_path: Path, chunks: int) -> dict | None:
    """p50 of the connector's per-load phases over warm loads (every chunk in the node cache) of `chunks` chunks."""
    if not stats_path.exists():
        return None
    loads = [json.loads(line) for line in stats_path.read_text().splitlines()]
    # Records that name node-cache misses (loads that also fetched, as earlier versions wrote) are not warm loads.
    warm = [load for load in loads if load["chunks"] == chunks and not load.get("node_cache_misses")]
    if not warm:
        return None
    return {"loads": len(warm), "tokens_p50": statistics.median(load["tokens"] for load in warm),
            **{f"{phase}_p50": statistics.median(load[phase] for load in warm)
               for phase in ("ms", "stage_ms", "compose_ms", "write_ms")}}


def run_contender(client, model: str, jobs: list[tuple[str, str]], contender: str, memory: dict, k: int, load: str,
                  max_tokens: int, base_url: str, facts_of: dict[str, list[pb.FactInput]], prefilled_ok: bool = False,
                  settle_after: bool = False) -> dict:
    """One contender at one load: "c<N>" = closed loop with N in flight, "r<R>" = open loop at R requests/s. A row
    in which any request lost its memory keeps that count (`lost_memory`) and loses the figures that cover every
    request (throughput, vLLM's histograms: NaN, so no ratio is drawn from them). `prefilled_ok`: kv requests the
    node prefilled instead of loading are counted (`prefilled`), not lost; `settle_after`: the connector counters
    are read once the background fetches the requests started have settled (their wait is no part of the row's
    figures)."""
    before = node_counters(base_url)

    def ask(job: tuple[str, str]) -> Sample:
        return one_request(client, model, job[0], job[1], memory, k, max_tokens, contender,
                           min(k, len(facts_of[job[0]])), prefilled_ok)

    samples, wall_s = run_load(ask, jobs, load)
    row = summarize(samples, wall_s)
    if settle_after:
        row["settle_s"] = settle(base_url)
    after = node_counters(base_url)
    for metric, histogram in (("engine_ttft_ms", "ttft"), ("engine_queue_ms", "queue"),
                              ("engine_prefill_ms", "prefill")):
        row[metric] = ({"mean": math.nan} if row["lost_memory"] else
                       engine_ttft_ms(before, after, histogram))
    row["engine_ttft_ms"]["p50"] = (math.nan if row["lost_memory"] else engine_ttft_percentile_ms(before, after))
    row["connector"] = connector_deltas(before, after)
    row["node_cache_hit_rate"] = hit_rate(before, after) if memory["mode"] == "kv" else None
    row["prefix_cache_hit_rate"] = counter_ratio(before, after, "prefix_cache_hits", "prefix_cache_queries")
    row["facts_fetched_per_request"] = (after.get("facts_fetched", 0.0) - before.get("facts_fetched", 0.0)) / len(jobs)
    return row


def warm_up(client, model: str, plan: WorkloadPlan, users: dict[str, str], max_tokens: int, node_cache: bool,
            compile_paths: bool = True, compile_user: str | None = None) -> None:
    """Compiles the engine's paths (every contender once, as `compile_user`, default the first of `users`) and,
    with `node_cache`, brings the users' facts into the node cache with questions that are not measured: one
    request per user retrieving its whole memory, or, where that is longer than the node serves, requests of the
    largest k. `users`: each user to warm -> the workload user whose memory it holds."""
    import openai

    k = max(plan.ks)

    def warm(user: str, base: str, seed: int) -> None:
        facts = len(plan.workload.facts[base])
        try:
            (question,) = plan.workload.warm_up_questions(base, 1, seed)
            one_request(client, model, user, question, CONTENDERS["kv"], facts, max_tokens)
        except openai.BadRequestError:  # the whole memory does not fit the node's model length
            for question in plan.workload.warm_up_questions(base, 2 * math.ceil(facts / k), seed):
                one_request(client, model, user, question, CONTENDERS["kv"], k, max_tokens)

    with ThreadPoolExecutor(max_workers=8) as pool:
        if compile_paths:
            list(pool.map(lambda memory: one_request(client, model, compile_user or next(iter(users)), "warm up",
                                                     memory, k, max_tokens), CONTENDERS.values()))
        if node_cache:
            list(tqdm(pool.map(warm, users, users.values(), range(900, 900 + len(users))), total=len(users),
                      desc="warm-up", unit="user"))


def _served_as(memory: dict) -> set[tuple]:
    """What a contender's requests can be, as vLLM sees them: the memory's mode as served, its order and tail."""
    mode, order = memory.get("mode", "kv"), memory.get("order", "ranked")
    if mode != "kv":
        return {(mode, order)}
    injected = {("kv", order, memory.get("recompute_tail_facts", 0))}
    return injected if memory.get("kv_crossover_tokens") == 0 else injected | {("text", order)}


def isolation_namespaces(contenders: dict[str, dict]) -> dict[str, str]:
    """Contender -> the suffix of its own users, for each contender that could send the very request an earlier one
    sends (same prompt, same cache salt): kv-auto is kv's request above the node's crossover and text's below it,
    kv-warm is kv's. Their users hold the same memories under other names, so that no contender's requests find
    another's blocks in vLLM's prefix cache (injected blocks are salted per plan, prefilled ones per user)."""
    seen: set[tuple] = set()
    namespaces = {}
    for name, memory in contenders.items():
        if name == KV_SECOND:  # kv's own users, asked again on purpose: their second request
            continue
        forms = _served_as(memory)
        if forms & seen:
            namespaces[name] = name
        seen |= forms
    return namespaces


def contender_users(plan: WorkloadPlan, contender: str, namespaces: dict[str, str]) -> dict[str, str]:
    """The users `contender` asks for in `plan` (kv-warm: the warm users; kv-second: kv's): workload user -> the
    user asked."""
    users = plan.warm_users if contender == "kv-warm" else plan.workload.users
    suffix = namespaces.get("kv" if contender == KV_SECOND else contender)
    return {user: f"{user}.{suffix}" if suffix else user for user in users}


def plan_contenders(args: argparse.Namespace, plans: list[WorkloadPlan]) -> dict[str, dict]:
    """The contenders of the run, in the order they run on each (load, k)."""
    tails = {tail_contender(m): {**CONTENDERS["kv"], "recompute_tail_facts": m} for m in args.tails}
    cold = any(plan.warm_users for plan in plans)
    return {**CONTENDERS, **({"kv-auto": KV_AUTO} if args.kv_auto else {}), **tails,
            **({name: CONTENDERS["kv"] for name in COLD_ONLY} if cold else {})}


def measured_contenders(contenders: dict[str, dict], only: list[str] | None) -> dict[str, dict]:
    """The contenders a measurement runs: those of `only` (in the run's order), all without it."""
    if not only:
        return contenders
    unknown = [name for name in only if name not in contenders]
    if unknown:
        raise SystemExit(f"--contenders: {', '.join(unknown)} not in this run ({', '.join(contenders)})")
    return {name: memory for name, memory in contenders.items() if name in only}


def cold_jobs(plan: WorkloadPlan, requests: int, load_index: int, loads: int,
              rng: random.Random) -> list[tuple[str, str]]:
    """The cold workload's jobs at one load: `requests` users none of whom another load asks, one question each, so
    that every request of a contender is for a user the node has not seen."""
    users = plan.workload.users
    if len(users) < requests * loads:
        raise SystemExit(f"cold: {requests} requests at each of {loads} load(s) ask {requests * loads} users the node "
                         f"has not seen; the workload has {len(users)} (--cold-users)")
    return plan.workload.jobs(requests, rng, users[load_index * requests : (load_index + 1) * requests])


def _memories(plans: list[WorkloadPlan], contenders: dict[str, dict], namespaces: dict[str, str]) -> Workload:
    """Every user's memory the run needs: each workload's users, and each isolated contender's copies."""
    users, facts, turns, questions = [], {}, {}, {}
    for plan in plans:
        for contender in ["", *(name for name in contenders if name in namespaces or name == "kv-warm")]:
            for base, user in contender_users(plan, contender, namespaces).items():
                if user not in facts:
                    users.append(user)
                    facts[user] = plan.workload.facts[base]
                    turns[user] = plan.workload.turns.get(base, [])
                    questions[user] = plan.workload.questions[base]
    return Workload(users, facts, turns, questions, "every workload of the run")


def _elapsed(started: float) -> str:
    return f"{time.monotonic() - started:.0f} s"


def prepare(session: Session, plans: list[WorkloadPlan], args: argparse.Namespace, tokenizer_dir: Path,
            contenders: dict[str, dict], namespaces: dict[str, str]) -> None:
    """Brings `session` to servers that serve every plan's users with their memories warm: starts what is not
    running, skips the phases done (a prepare cut short resumes), saving the session after each step."""
    started, work = time.monotonic(), Path(session.work_dir)
    synthetic = args.shape is not None
    model_dir = (build_dummy_model(work / args.shape, args.shape, tokenizer_dir, args.kv_dtype) if synthetic
                 else tokenizer_dir)
    session.model_dir = str(model_dir)
    memories = _memories(plans, contenders, namespaces)
    if not session.service_healthy():
        service = MemoryServiceProcess(work / "data", work / "memory_service.log", *args.service_flags.split())
        try:
            service.start()
        except BaseException:  # not recorded yet: stopped here (a prepare stopped meanwhile leaves nothing behind)
            if service.process is not None:
                service.stop(signal.SIGKILL)
            raise
        session.service = ServerProcess(service.pid, "memory_service", service.address, str(service.log_path))
        session.service_metrics_port = service.metrics_port
        session.save()
        print(f"memory service up at {service.address} (pid {service.pid}), {_elapsed(started)}", flush=True)
    assert session.service is not None
    with grpc.insecure_channel(session.service.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        if "ingest" not in session.done:
            ingest(stub, memories)
            session.mark("ingest")
            print(f"ingested {len(memories.users)} users' facts, {_elapsed(started)}", flush=True)
        if "kv" not in session.done:
            _compute_kv(session, stub, sum(len(facts) for facts in memories.facts.values()), args, synthetic)
            session.mark("kv")
            print(f"fact KV ready, {_elapsed(started)}", flush=True)
    if not session.node_healthy():
        node_flags = [*args.node_flags.split(), "--kv-dtype", args.kv_dtype,
                      *(flag for plan in plans for flag in plan.node_flags)]
        if synthetic:
            node_flags += ["--load-format", "dummy"]
        if args.load_stats:
            node_flags += ["--load-stats-path", str(work / "loads.jsonl")]
        if args.durable_reads:
            node_flags += ["--kv-durable-tier", str(work / "data" / "kv" / "blobs")]
        cold = [plan for plan in plans if plan.warm_users]
        if cold:
            session.node_cache_mb = cold_node_cache_mb(model_dir, args.kv_dtype, cold[0].workload,
                                                       len(cold[0].warm_users))
            node_flags += ["--node-cache-mb", str(session.node_cache_mb)]
        print("starting the inference node ...", flush=True)
        node = InferenceNodeProcess(session.service.address, model_dir, work / "node", *node_flags)
        try:
            node.start()
        except BaseException:  # not recorded yet: stopped here
            node.stop()
            raise
        assert node.process is not None
        session.node = ServerProcess(node.process.pid, "inference_node", node.base_url, str(node.log_path),
                                     own_session=True)
        session.save()
        print(f"inference node up at {node.base_url} (pid {node.process.pid}), {_elapsed(started)}", flush=True)
    from openai import OpenAI

    assert session.node is not None
    client = OpenAI(base_url=f"{session.node.address}/v1", api_key="bench", timeout=600)
    for plan in plans:
        if f"warm:{plan.name}" not in session.done:
            users = {user: base for name, memory in contenders.items() if memory["mode"] == "kv"
                     and name not in COLD_ONLY for base, user in contender_users(plan, name, namespaces).items()}
            # The cold workload's measured users stay unseen: its paths compile as a kv-warm user (warmed anyway).
            compile_user = next(iter(contender_users(plan, "kv-warm", namespaces).values()), None)
            warm_up(client, session.model_dir, plan, users, args.max_tokens, plan.warm_node_cache,
                    compile_user=compile_user)
            settle(session.node.address)  # what the warm-up fetches in the background is in before measuring
            session.mark(f"warm:{plan.name}")
            print(f"{plan.name}: warmed up, {_elapsed(started)}", flush=True)


def _compute_kv(session: Session, stub, total: int, args: argparse.Namespace, synthetic: bool) -> None:
    """Runs a KV worker (unless the session's is still running) until every fact has KV."""
    assert session.service is not None
    if session.worker is None or not session.worker.running():
        log = Path(session.work_dir) / "worker.log"
        worker_module = "benchmarks.synthetic_worker" if synthetic else "precompute_worker"
        worker = subprocess.Popen([sys.executable, "-m", worker_module, "--memory-service", session.service.address,
                                   "--model", session.model_dir, "--dtype", args.kv_dtype, "--exit-when-idle"],
                                  stdout=subprocess.DEVNULL, stderr=log.open("ab"))
        session.worker = ServerProcess(worker.pid, worker_module, log=str(log))
        session.save()
    with tqdm(total=total, desc="precomputing fact KV", unit="fact") as progress:
        while True:
            done = max((p.done for p in stub.GetStats(pb.GetStatsRequest()).profiles), default=0)
            progress.update(done - progress.n)
            if done >= total:
                return
            if not session.worker.running():
                raise SystemExit(f"the KV worker exited with {done} of {total} facts done: see {session.worker.log}")
            time.sleep(1.0)


def measure(session: Session, plan: WorkloadPlan, args: argparse.Namespace, loads: list[str],
            contenders: dict[str, dict], namespaces: dict[str, str], on_result) -> dict:
    """Every contender on `plan`'s same questions, one after the other per (load, k); `on_result` after each."""
    from openai import OpenAI

    assert session.node is not None
    model, base_url = session.model_dir, session.node.address
    client = OpenAI(base_url=f"{base_url}/v1", api_key="bench", timeout=600)
    stats_path = Path(session.work_dir) / "loads.jsonl"
    stats_path.unlink(missing_ok=True)
    outcome: dict = {"results": {}, "node_cache_mb": session.node_cache_mb, "source": plan.workload.source,
                     "isolated": {name: suffix for name, suffix in namespaces.items() if name in contenders}}
    rng = random.Random(5)
    cold = bool(plan.warm_users)
    contenders = {name: memory for name, memory in contenders.items() if name not in COLD_ONLY or cold}
    if KV_SECOND in contenders and "kv" not in contenders:
        raise SystemExit("kv-second asks kv's users their second question: measure kv with it")
    if cold:
        for index in range(len(loads)):  # says now, not after the first load, that the users do not suffice
            cold_jobs(plan, args.requests, index, len(loads), random.Random(0))
    with tqdm(total=len(loads) * len(contenders) * len(plan.ks) * args.requests, desc=f"{plan.name} requests",
              unit="req") as progress:
        for index, load in enumerate(loads):
            for k in plan.ks:
                jobs = (cold_jobs(plan, args.requests, index, len(loads), rng) if cold
                        else plan.workload.jobs(args.requests, rng))
                for contender, memory in contenders.items():  # same questions, one after the other
                    rename = contender_users(plan, contender, namespaces)
                    asked = jobs
                    if contender == "kv-warm":  # the same requests' shape, against users whose KV the node cache holds
                        warm_up(client, model, plan, {user: base for base, user in rename.items()}, args.max_tokens,
                                node_cache=True, compile_paths=False)
                        settle(base_url)
                        asked = plan.workload.jobs(args.requests, rng, plan.warm_users)
                    elif contender == KV_HOST:  # each user touched once (its whole memory): host tier, not device
                        warm_up(client, model, plan, {rename[user]: user for user, _ in jobs}, args.max_tokens,
                                node_cache=True, compile_paths=False)
                        settle(base_url)
                    elif contender == KV_SECOND:  # kv's users again, another question: other facts
                        asked = plan.workload.second_questions(jobs, rng)
                    row = run_contender(client, model, [(rename[user], question) for user, question in asked],
                                        contender, memory, k, load, args.max_tokens, base_url,
                                        {user: plan.workload.facts[base] for base, user in rename.items()},
                                        args.prefilled_ok, settle_after=cold)
                    outcome["results"].setdefault(load, {}).setdefault(contender, {})[str(k)] = row
                    progress.update(len(asked))
                    on_result()
                    print(f"[{plan.name} {describe(load)} k={k}] {contender}: {row['requests']} requests, "
                          f"query-to-first-token p50 {row['query_to_first_token_ms']['p50']:.1f} ms, engine TTFT "
                          f"{_fmt(row['engine_ttft_ms']['mean'], '{:.1f}')} ms (queue "
                          f"{_fmt(row['engine_queue_ms']['mean'], '{:.1f}')}), {row['throughput_rps']:.2f} req/s, "
                          f"cached {row['mean_cached_tokens']:.0f} of {row['mean_prompt_tokens']:.0f} tokens"
                          + _connector_note(row), flush=True)
    if args.load_stats:
        outcome["connector_phases"] = {str(k): connector_phases(stats_path, k + 1) for k in plan.ks}
    return outcome


def _connector_note(row: dict) -> str:
    """The connector's deltas worth a progress line: what was prefilled, fetched, copied, warmed."""
    deltas = row.get("connector") or {}
    parts = [f"{name} {deltas[name]:.0f}" for name in ("partial_loads", "async_loads", "load_failures",
                                                       "host_tier_hits", "facts_fetched", "durable_tier_reads",
                                                       "warmed_chunks")
             if deltas.get(name)]
    if row.get("prefilled"):
        parts.insert(0, f"prefilled {row['prefilled']}")
    if deltas.get("source_gbps"):
        parts.append(f"fetch {deltas['source_gbps']:.2f} GB/s")
    return f"; {', '.join(parts)}" if parts else ""


# What a session's memories and servers are made with: an attached run takes them from the state file.
SETUP_ARGS = ("workloads", "users", "facts_per_user", "fact_clauses", "locomo", "varying_facts", "long_users",
              "long_clauses", "long_max_model_len", "cold_users", "model", "shape", "kv_dtype",
              "load_stats", "durable_reads", "node_flags", "service_flags", "max_tokens")


def _setup_of(args: argparse.Namespace) -> dict[str, Any]:
    return {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()
            if name in SETUP_ARGS}


def _attach(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Session:
    """The prepared session of --attach, its setup taken into `args`; exits naming what is gone if it is not
    serving any more."""
    state = Path(args.attach)
    if not state.exists():
        raise SystemExit(f"{state}: no prepared servers (run the prepare stage first)")
    session = Session.load(state)
    gone = session.gone()
    if gone:
        raise SystemExit("the prepared servers are gone (rerun the prepare stage):\n  " + "\n  ".join(gone))
    requested = args.workloads if args.workloads_given else session.setup["workloads"]
    unprepared = [name for name in requested if f"warm:{name}" not in session.done]
    if unprepared:
        parser.error(f"--attach: {', '.join(unprepared)} not prepared in {state} ({', '.join(session.done)})")
    for name, value in session.setup.items():
        setattr(args, name, Path(value) if name in ("locomo", "model") and value else value)
    args.workloads = requested
    return session


def _only_node_flags_differ(prepared: dict, wanted: dict) -> bool:
    return prepared["node_flags"] != wanted["node_flags"] and all(
        prepared.get(name) == value for name, value in wanted.items() if name != "node_flags")


def _replace_node(session: Session, node_flags: str) -> None:
    """Another node on a prepared session's memory service and memories (the same users, KV and data): the node
    stops, and the next prepare phases start one with `node_flags` and warm it up as a new node (it has seen no
    user)."""
    print(f"node flags changed: stopping the node, keeping the memory service and memories; new node flags: "
          f"{node_flags}", flush=True)
    if session.node is not None:
        session.node.stop()
    session.node = None
    session.setup["node_flags"] = node_flags
    session.done = [phase for phase in session.done if not phase.startswith("warm:")]
    session.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None,
                        help="default: synthetic (with --attach: every prepared workload)")
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
    parser.add_argument("--contenders", nargs="+", default=None, metavar="NAME",
                        help="measure only these of the run's contenders (e.g. kv text text-stable off)")
    parser.add_argument("--prefilled-ok", action="store_true",
                        help="a kv request the node prefilled instead of loading (its miss policy's partial load, or "
                        "a fallback) is counted in its row's `prefilled`, not as a request that lost its memory "
                        "(its memory is in the prompt); for nodes whose miss policy is not `wait`")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1], help="closed-loop loads")
    parser.add_argument("--rate", type=float, nargs="*", default=[], help="open-loop loads (requests/s, Poisson)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", type=Path, default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="serve this shape with dummy weights and synthetic fact KV (tokenizer from --model)")
    parser.add_argument("--kv-dtype", default="float32", help="the worker's compute and storage dtype")
    parser.add_argument("--load-stats", action="store_true",
                        help="record the connector's per-load phases (synchronizes the device per load)")
    parser.add_argument("--durable-reads", action="store_true",
                        help="the node reads fact KV from the memory service's KV directory itself "
                        "(--kv-durable-tier), asking the service only for what it lacks")
    parser.add_argument("--output", type=Path, default=Path("results/serve"))
    parser.add_argument("--node-flags", default="--dtype float32 --max-model-len 4096",
                        help="vLLM flags for the node")
    parser.add_argument("--service-flags", default="", help="memory service flags (e.g. --embedding-threads 4)")
    sessions = parser.add_mutually_exclusive_group()
    sessions.add_argument("--prepare", metavar="STATE", default=None,
                          help="start the servers of every --workloads, give the users their memories, warm them up, "
                          "record it all in the state file STATE (its folder holds their data and logs) and leave "
                          "them running; resumes a prepare cut short")
    sessions.add_argument("--attach", metavar="STATE", default=None,
                          help="measure against the servers STATE records (their memories and node as prepared; "
                          "the measurement flags are this call's)")
    sessions.add_argument("--stop", metavar="STATE", default=None, help="stop the servers STATE records")
    parser.add_argument("--nodes", type=int, default=0,
                        help="fleet mode: this many nodes behind vLLM's router, kv only, synthetic workload "
                        "(benchmarks/fleet.py)")
    parser.add_argument("--routing", nargs="+", choices=sorted(ROUTINGS), default=["consistent-hash"],
                        help="fleet mode: the router's policies, one after the other on the same nodes")
    args = parser.parse_args()
    args.workloads_given = args.workloads is not None
    args.workloads = args.workloads or ["synthetic"]
    if args.stop:
        if Path(args.stop).exists():
            Session.load(Path(args.stop)).stop()
        print(f"stopped the servers of {args.stop}")
        return
    if args.nodes and (args.prepare or args.attach):
        parser.error("--nodes: the fleet mode starts its own servers (no --prepare or --attach)")
    session = _attach(args, parser) if args.attach else None

    loads = [f"c{c}" for c in args.concurrency] + [f"r{r:g}" for r in args.rate]
    if not loads and not args.prepare:
        parser.error("give at least one --concurrency or --rate")
    if args.nodes:
        run_fleet(args, (args.model or build_smollm2()).resolve(), loads)
        return
    plans = plan_workloads(args)
    contenders = plan_contenders(args, plans)
    if not args.prepare:
        contenders = measured_contenders(contenders, args.contenders)
    if args.prepare:
        if len(plans) > 1 and any(plan.warm_users for plan in plans):
            parser.error("--prepare: the cold workload needs a node of its own (a node cache for two users)")
        state = Path(args.prepare)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # --stop ends a prepare still running: cleanly
        with exclusive(state):  # a prepare cut short at a call's limit may still run: this one waits for it
            session = Session(str(state.parent / "work"), str(state), {**_setup_of(args),
                                                                        "namespaces": isolation_namespaces(contenders)})
            if state.exists():  # resume a prepare cut short, made with the same arguments
                prepared = Session.load(state)
                if _only_node_flags_differ(prepared.setup, session.setup):
                    _replace_node(prepared, session.setup["node_flags"])
                elif prepared.setup != session.setup:
                    parser.error(f"--prepare: {state} was prepared with other arguments: --stop it first")
                session = prepared
            session.preparer = ServerProcess(os.getpid(), "benchmarks.serve")
            session.save()
            try:
                prepare(session, plans, args, (args.model or build_smollm2()).resolve(), contenders,
                        session.setup["namespaces"])
            finally:
                session.preparer = None
                session.save()
        print(f"prepared: {', '.join(plan.name for plan in plans)}; state {state}", flush=True)
        return
    namespaces = session.setup["namespaces"] if session is not None else isolation_namespaces(contenders)
    unisolated = [name for name in isolation_namespaces(contenders) if name not in namespaces]
    if unisolated:
        parser.error(f"--attach: {', '.join(unisolated)} would share another contender's users: prepare with them")
    model_label = (f"{args.shape} shape, DUMMY weights, SYNTHETIC fact KV ({args.kv_dtype})" if args.shape
                   else f"{(args.model or Path('SmolLM2-135M-Instruct')).name}, {args.kv_dtype}")
    args.output.mkdir(parents=True, exist_ok=True)
    workloads: dict[str, dict] = {}

    def save() -> None:  # after every measurement: a run cut short keeps what it measured
        (args.output / "results.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "model": model_label,
            "synthetic_kv": args.shape is not None, "workloads": workloads}, indent=2))

    for plan in plans:
        label = f"{model_label}; {plan.name} workload: {plan.workload.source}, {len(plan.workload.users)} users"
        workloads[plan.name] = {"label": label}
        if session is not None:
            workloads[plan.name].update(measure(session, plan, args, loads, contenders, namespaces, save))
        else:
            with tempfile.TemporaryDirectory(prefix=f"inferscale-serve-{plan.name}-") as workdir:
                own = Session(workdir)
                try:
                    prepare(own, [plan], args, (args.model or build_smollm2()).resolve(), contenders, namespaces)
                    workloads[plan.name].update(measure(own, plan, args, loads, contenders, namespaces, save))
                finally:
                    own.stop()
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
    lost = [(name, load, contender, k, row) for name, outcome in workloads.items()
            for load, by_contender in outcome["results"].items() for contender, by_k in by_contender.items()
            for k, row in by_k.items() if row.get("lost_memory")]
    if lost:
        print("\n" + "!" * 78 + "\nREQUESTS LOST THEIR MEMORY: these rows are not results (their throughput and vLLM "
              "figures are withheld, their latencies cover only the requests that kept it):")
        for name, load, contender, k, row in lost:
            print(f"  {name} {load} {contender} k={k}: {row['lost_memory']} lost, e.g. {row['lost_memory_examples']}")
        sys.exit(3)


def engine_breakdown(row: dict, off: dict) -> str:
    """Where a contender's engine TTFT goes beyond the no-memory floor: vLLM's queue time (arrival to first scheduled,
    which holds a wait for a prefetch), prefill time (the first forward: attention over the memory, the
    connector's in-step work) and the rest (detokenizing, the engine's output path)."""
    parts = {metric: row[metric]["mean"] - off[metric]["mean"]
             for metric in ("engine_ttft_ms", "engine_queue_ms", "engine_prefill_ms")}
    rest = parts["engine_ttft_ms"] - parts["engine_queue_ms"] - parts["engine_prefill_ms"]
    return (f"engine TTFT {parts['engine_ttft_ms']:+.1f} ms = queue {parts['engine_queue_ms']:+.1f} + prefill "
            f"{parts['engine_prefill_ms']:+.1f} + rest {rest:+.1f}")


def _delta(name: str):
    return lambda row: (row.get("connector") or {}).get(name)


def _engine(row: dict, point: str) -> float:
    value = row.get("engine_ttft_ms", {}).get(point)
    return math.nan if value is None or row.get("lost_memory") else value


def issue_lines(rows: dict) -> list[str]:
    """Engine TTFT (vLLM, mean and p50) as issue 41's targets read it: kv and kv-auto over text, the users of the
    node's tiers (kv-warm, kv-host, kv-second) over off, and the bandwidth of the node's byte path over the run's
    fully cold contenders."""
    lines = []
    if "text" in rows:
        for name in ("kv", "kv-auto"):
            if name in rows:
                row, text = rows[name], rows["text"]
                lines.append(f"engine TTFT {name}/text: mean {ratio(_engine(row, 'mean'), _engine(text, 'mean'))}, "
                             f"p50 {ratio(_engine(row, 'p50'), _engine(text, 'p50'))}")
    if "off" in rows:
        for name in ("kv-warm", "kv-host", "kv-second"):
            if name in rows:
                mean = _engine(rows[name], "mean") - _engine(rows["off"], "mean")
                p50 = _engine(rows[name], "p50") - _engine(rows["off"], "p50")
                lines.append(f"engine TTFT {name} - off: mean {_fmt(mean, '{:+.1f}') or 'n/a'} ms, "
                             f"p50 {_fmt(p50, '{:+.1f}') or 'n/a'} ms")
    moved = [(rows[name].get("connector") or {}) for name in ("kv", "kv-auto") if name in rows]
    micros = sum(c.get("source_fetch_micros") or 0 for c in moved)
    if micros:
        gbps = sum(c.get("source_bytes_fetched") or 0 for c in moved) / micros / 1e3
        lines.append(f"byte path (node's measure, kv and kv-auto's fetches): {gbps:.2f} GB/s")
    return lines


def ratio(kv: float, text: float) -> str:
    return f"{kv / text:.2f}" if text and not math.isnan(text) and not math.isnan(kv) else "n/a"


def _fmt(value, spec: str) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else spec.format(value)


def report(results: dict, title: str, node_cache_mb: int | None = None) -> None:
    """Blocks in `vllm bench serve`'s layout, one per k, each contender's lines side by side, then kv's ratios to
    text and to text-stable, each tail's TTFT cost over kv, and (cold workload) what a node-cache miss costs."""
    names = list(results)
    print(f"\n{'=' * 20} InferScale Serving Benchmark Result {'=' * 20}\n{title}")
    metric_rows = [("Requests that lost their memory", lambda r: r.get("lost_memory"), "{:d}"),
                   ("Request throughput (req/s)", lambda r: r["throughput_rps"], "{:.2f}"),
                   ("Mean prompt tokens", lambda r: r["mean_prompt_tokens"], "{:.0f}"),
                   ("Mean cached prompt tokens", lambda r: r["mean_cached_tokens"], "{:.0f}"),
                   ("Node-cache hit rate", lambda r: r["node_cache_hit_rate"], "{:.2f}"),
                   ("Prefix-cache hit rate (vLLM)", lambda r: r.get("prefix_cache_hit_rate"), "{:.2f}"),
                   ("Facts fetched per request", lambda r: r.get("facts_fetched_per_request"), "{:.1f}"),
                   ("kv requests prefilled, not loaded", lambda r: r.get("prefilled"), "{:d}"),
                   ("kv-auto requests served as text", lambda r: r.get("served_as_text") or None, "{:d}"),
                   *((f"Connector: {label}", _delta(name), "{:.0f}") for name, label in (
                       ("loads", "loads"), ("partial_loads", "partial loads"), ("async_loads", "async loads"),
                       ("load_failures", "load failures"), ("host_tier_hits", "host-tier hits"),
                       ("facts_fetched", "chunks fetched"), ("durable_tier_reads", "of them from the durable tier"),
                       ("warmed_chunks", "chunks warmed"))),
                   ("Byte path, service fetch (GB/s)", _delta("source_gbps"), "{:.2f}"),
                   ("Host tier to device (GB/s)", _delta("host_gbps"), "{:.2f}")]
    width = max(12, max(len(name) for name in names) + 2)
    for k in next(iter(results.values())):
        rows = {name: results[name][k] for name in names if k in results[name]}
        first = next(iter(rows.values()))
        print(f"{'-' * 22} k = {k} facts ({first['requests'] + first.get('lost_memory', 0)} requests "
              f"each) {'-' * 22}")
        print(f"{'':<34}" + "".join(f"{name:>{width}}" for name in rows))
        for label, value, spec in metric_rows:
            print(f"{label:<34}" + "".join(f"{_fmt(value(r), spec):>{width}}" for r in rows.values()))
        for heading, metric, points in (("Query-to-first-token (ms)", "query_to_first_token_ms", ("p50", "p90", "p99")),
                                        ("Memory step, RetrieveAndStage (ms)", "memory_step_ms", ("p50", "p99")),
                                        ("TTFT after the memory step (ms)", "ttft_ms", ("p50", "p90", "p99")),
                                        ("Engine TTFT, vLLM (ms)", "engine_ttft_ms", ("mean", "p50")),
                                        ("Engine queue time, vLLM (ms)", "engine_queue_ms", ("mean",)),
                                        ("Engine prefill time, vLLM (ms)", "engine_prefill_ms", ("mean",)),
                                        ("TPOT (ms)", "tpot_ms", ("p50", "p99"))):
            for point in points:
                print(f"{heading.replace(' (ms)', f' {point} (ms)'):<34}"
                      + "".join(f"{_fmt(r[metric].get(point) if metric in r else None, '{:.1f}'):>{width}}"
                                for r in rows.values()))
        kv = rows.get("kv", first)
        for baseline in ("text", "text-stable") if "kv" in rows else ():
            if baseline in rows and (kv.get("lost_memory") or rows[baseline].get("lost_memory")):
                print(f"kv/{baseline}: n/a (requests lost their memory: not a result)")
            elif baseline in rows:
                other = rows[baseline]
                print(f"kv/{baseline}: query-to-first-token p50 "
                      f"{ratio(kv['query_to_first_token_ms']['p50'], other['query_to_first_token_ms']['p50'])}, "
                      f"TTFT p50 {ratio(kv['ttft_ms']['p50'], other['ttft_ms']['p50'])}, engine TTFT (vLLM mean) "
                      f"{ratio(kv['engine_ttft_ms']['mean'], other['engine_ttft_ms']['mean'])}, throughput "
                      f"{ratio(kv['throughput_rps'], other['throughput_rps'])}x")
        if "off" in rows:
            for name, row in rows.items():
                if name != "off" and "engine_queue_ms" in row and not row.get("lost_memory"):
                    print(f"{name} - off: {engine_breakdown(row, rows['off'])}")
        for line in issue_lines(rows):
            print(line)
        for name, row in rows.items():
            if name.startswith("kv-tail"):
                cost = row["engine_ttft_ms"]["mean"] / kv["engine_ttft_ms"]["mean"] - 1
                print(f"{name}: engine TTFT {_fmt(row['engine_ttft_ms']['mean'], '{:.1f}')} ms, "
                      f"{_fmt(100 * cost, '{:+.1f}')}% over kv")
        if "kv-warm" in rows and (kv.get("lost_memory") or rows["kv-warm"].get("lost_memory")):
            print("cold node cache: n/a (requests lost their memory: not a result)")
        elif "kv-warm" in rows:
            warm, miss_rate = rows["kv-warm"], 1 - (kv["node_cache_hit_rate"] or 0.0)
            extra = kv["query_to_first_token_ms"]["p50"] - warm["query_to_first_token_ms"]["p50"]
            fetched = kv.get("facts_fetched_per_request") or 0.0
            print(f"cold node cache ({node_cache_mb} MiB): miss rate {miss_rate:.2f}, "
                  f"{fetched:.1f} facts fetched per request; query-to-first-token p50 {extra:+.1f} ms against the "
                  f"warm users" + (f" ({extra / fetched:.2f} ms per fetched fact)" if fetched else ""))
    print("=" * 78)


if __name__ == "__main__":
    main()
