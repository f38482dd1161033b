"""The serving benchmark's fleet mode: `python -m benchmarks.serve --nodes N --routing consistent-hash round-robin`.

N inference nodes behind vLLM's router (`harness.router`) share one memory service and its worker. The synthetic
workload's users ask kv questions through the router in a shuffled order, each request naming its user in the header
a gateway would set, under each routing in turn on the same nodes (a fresh router, then a warm-up, per routing).
Each node's cache holds FLEET_CACHE_SHARE times its fair share of the users' fact KV (1/N of the users), as a fleet's
caches do: no node holds every user. Per routing, load and k: the node-cache hit rate of the measured requests (all
nodes together), query-to-first-token p50/p99 through the router (client clock), each node's requests with the
busiest node's over the mean, and facts fetched from the memory service per request. Writes
<output>/fleet/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.serve_requests import (
    CONTENDERS,
    Sample,
    Workload,
    describe,
    ingest,
    one_request,
    run_load,
    summarize,
    synthetic_workload,
)
from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from harness.router import FAILOVER_FLAGS, USER_HEADER, RouterProcess, metric_total, prometheus_samples, start_nodes
from inferscale.v1 import memory_pb2_grpc
from precompute_worker.progress import wait_for_kv

FLEET_CACHE_SHARE = 1.25


@dataclass(frozen=True)
class NodeCounts:
    """One node's counters at one moment (from its /metrics)."""

    kv_requests: float
    node_cache_hits: float
    node_cache_lookups: float
    facts_fetched: float

    @classmethod
    def read(cls, node: InferenceNodeProcess) -> NodeCounts:
        samples = prometheus_samples(f"{node.base_url}/metrics")
        return cls(metric_total(samples, "inferscale_node_memory_requests_total", 'mode="kv"'),
                   metric_total(samples, "inferscale_connector_node_cache_hits_total"),
                   metric_total(samples, "inferscale_connector_node_cache_lookups_total"),
                   metric_total(samples, "inferscale_connector_facts_fetched_total"))


def fleet_node_cache_mb(model_dir: Path, kv_dtype: str, workload: Workload, nodes: int) -> int:
    """FLEET_CACHE_SHARE times one node's share of the users' fact KV (their mean KV, this model and dtype)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from inferscale_kv.layout import fact_token_ids
    from inferscale_kv.shape import KvShape

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    shape = KvShape.from_config(AutoConfig.from_pretrained(model_dir))
    itemsize = torch.empty(0, dtype=getattr(torch, kv_dtype if kv_dtype != "fp8_e4m3" else "float32")).element_size()
    tokens = sum(len(fact_token_ids(tokenizer, fact.text)) for user in workload.users for fact in workload.facts[user])
    return math.ceil(FLEET_CACHE_SHARE / nodes * tokens * shape.elements_per_token() * itemsize / (1 << 20))


def _settled(nodes: list[InferenceNodeProcess], lookups_before: float, expected: float) -> list[NodeCounts]:
    """The nodes' counters once the connector's lookups stopped moving (they arrive with the engines' step stats,
    after the responses): at `expected` more, or at fewer after 10 s (vLLM's prefix cache served some prompts)."""
    started = time.monotonic()
    counts = [NodeCounts.read(node) for node in nodes]
    while True:
        time.sleep(1.0)
        again = [NodeCounts.read(node) for node in nodes]
        lookups = sum(count.node_cache_lookups for count in again)
        waited = time.monotonic() - started
        if lookups == sum(count.node_cache_lookups for count in counts) and (
                lookups - lookups_before >= expected or waited > 10) or waited > 60:
            return again
        counts = again


def measure_routing(routing: str, nodes: list[InferenceNodeProcess], workload: Workload, model: str,
                    args: argparse.Namespace, loads: list[str], rng: random.Random, work: Path) -> dict:
    """One routing on the running nodes: a fresh router, a warm-up of every user, then each (load, k)."""
    from openai import OpenAI

    router = RouterProcess([node.base_url for node in nodes], work, routing, *FAILOVER_FLAGS).start()
    try:
        clients = {user: OpenAI(base_url=f"{router.base_url}/v1", api_key="bench", timeout=600,
                                default_headers={USER_HEADER: user}) for user in workload.users}
        k_max = max(args.k)
        rounds = 2 * math.ceil(max(len(workload.facts[user]) for user in workload.users) / k_max)
        warm_jobs = [(user, question) for n, user in enumerate(workload.users)
                     for question in workload.warm_up_questions(user, rounds, seed=900 + n)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(tqdm(pool.map(lambda job: one_request(clients[job[0]], model, job[0], job[1], CONTENDERS["kv"], k_max,
                                                       args.max_tokens), warm_jobs),
                      total=len(warm_jobs), desc=f"{routing} warm-up", unit="req"))
        rows: dict = {}
        for load in loads:
            for k in args.k:
                jobs = workload.jobs(args.requests, rng)
                rng.shuffle(jobs)  # users in no fixed order: round robin would otherwise pin user i to node i mod N
                before = [NodeCounts.read(node) for node in nodes]
                def ask(job: tuple[str, str], k: int = k) -> Sample:
                    return one_request(clients[job[0]], model, job[0], job[1], CONTENDERS["kv"], k,
                                       args.max_tokens, routing)

                samples, wall_s = run_load(ask, jobs, load)
                lookups_before = sum(count.node_cache_lookups for count in before)
                after = _settled(nodes, lookups_before, len(jobs) * (k + 1))
                row = summarize(samples, wall_s)
                per_node = [a.kv_requests - b.kv_requests for a, b in zip(after, before, strict=True)]
                lookups = sum(a.node_cache_lookups - b.node_cache_lookups for a, b in zip(after, before, strict=True))
                hits = sum(a.node_cache_hits - b.node_cache_hits for a, b in zip(after, before, strict=True))
                fetched = sum(a.facts_fetched - b.facts_fetched for a, b in zip(after, before, strict=True))
                row.update(node_cache_hit_rate=hits / lookups if lookups else None, requests_per_node=per_node,
                           busiest_over_mean=max(per_node) / (sum(per_node) / len(per_node)),
                           facts_fetched_per_request=fetched / len(jobs))
                rows.setdefault(load, {})[str(k)] = row
        return rows
    finally:
        router.stop()


def run_fleet(args: argparse.Namespace, model_dir: Path, loads: list[str]) -> None:
    """The fleet benchmark (see the module's docstring); prints a block per routing and writes results.json."""
    if args.nodes < 2 or args.shape:
        raise SystemExit("benchmarks.serve: --nodes: at least 2 nodes, serving --model's own weights (no --shape)")
    workload = synthetic_workload(args.users, args.facts_per_user, args.fact_clauses)
    cache_mb = fleet_node_cache_mb(model_dir, args.kv_dtype, workload, args.nodes)
    output = args.output / "fleet"
    output.mkdir(parents=True, exist_ok=True)
    label = (f"{model_dir.name}, {args.kv_dtype}; {args.nodes} nodes behind vllm-router, node cache {cache_mb} MiB "
             f"each; {workload.source}, {len(workload.users)} users x {args.facts_per_user} facts")
    results: dict = {"label": label, "node_cache_mb": cache_mb, "routings": {}}
    with tempfile.TemporaryDirectory(prefix="inferscale-serve-fleet-") as workdir:
        work = Path(workdir)
        service = MemoryServiceProcess(work / "data", work / "memory_service.log", *args.service_flags.split()).start()
        nodes: list[InferenceNodeProcess] = []
        try:
            with service.channel() as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                ingest(stub, workload)
                worker = subprocess.Popen([sys.executable, "-m", "precompute_worker", "--memory-service",
                                           service.address, "--model", str(model_dir), "--dtype", args.kv_dtype,
                                           "--exit-when-idle"],
                                          stdout=subprocess.DEVNULL, stderr=(work / "worker.log").open("wb"))
                wait_for_kv(stub, sum(len(facts) for facts in workload.facts.values()), worker)
                worker.wait(timeout=600)
            print(f"starting {args.nodes} inference nodes ...", flush=True)
            node_flags = [*args.node_flags.split(), "--kv-dtype", args.kv_dtype, "--user-header", USER_HEADER,
                          "--node-cache-mb", str(cache_mb)]
            nodes = start_nodes([InferenceNodeProcess(service.address, model_dir, work / f"node-{index}", *node_flags)
                                 for index in range(args.nodes)])
            rng = random.Random(5)
            for routing in args.routing:
                results["routings"][routing] = measure_routing(routing, nodes, workload, str(model_dir), args, loads,
                                                               rng, work)
                (output / "results.json").write_text(json.dumps(results, indent=2))
        finally:
            for node in nodes:
                node.stop()
            service.stop()
    report(results, loads, args.k)
    print(f"\nJSON: {output / 'results.json'}")


def report(results: dict, loads: list[str], ks: list[int]) -> None:
    print(f"\n{'=' * 20} InferScale fleet benchmark {'=' * 20}\n{results['label']}")
    print(f"{'routing':<17}{'load':<26}{'k':>4}{'requests':>10}{'node-cache hit':>16}{'QtFT p50':>10}"
          f"{'QtFT p99':>10}  {'requests per node':<20}{'busiest/mean':>13}{'fetched/req':>13}")
    for routing, rows in results["routings"].items():
        for load in loads:
            for k in ks:
                row = rows[load][str(k)]
                qtft = row["query_to_first_token_ms"]
                hit = row["node_cache_hit_rate"]
                print(f"{routing:<17}{describe(load):<26}{k:>4}{row['requests']:>10}"
                      f"{(f'{hit:.3f}' if hit is not None else 'n/a'):>16}{qtft['p50']:>10.1f}{qtft['p99']:>10.1f}  "
                      f"{' / '.join(f'{count:.0f}' for count in row['requests_per_node']):<20}"
                      f"{row['busiest_over_mean']:>13.2f}{row['facts_fetched_per_request']:>13.1f}")
    print("=" * 68)
