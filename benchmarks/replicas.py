"""Memory service per-call costs and latency: one replica on the embedded defaults (SQLite, a local directory)
against replicas sharing a real PostgreSQL and a real S3-compatible store (SeaweedFS), all on this machine.

    python -m benchmarks.replicas [--users 120] [--facts-per-user 100] [--calls 100] [--callers 16] [--seconds 15]

Per RetrieveAndStage call, for users the replica has cached and users it has not: the service's CPU milliseconds
(its processes' user + system time, /proc), coordination statements (the service's own counter), object-store
requests (the store's counter: LanceDB's reads and the KV tier's), and the CPU milliseconds of the PostgreSQL and
SeaweedFS servers, with the query embedded by the service and by the caller (`python -m benchmarks.capacity` scales
them to a fleet). Costs are taken after the store's periodic compaction has run once over the ingested facts (as in
steady state); an uncached user's read then touches few LanceDB fragments. Then p50/p99 of RetrieveAndStage under a
closed loop of --callers at 1 and 3 replicas, after every replica has cached every user (the client shares the
machine's cores with the replicas, the database and the store). Writes results.json and report.md under --output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from tqdm import tqdm

from benchmarks.synthetic import synthetic_facts, synthetic_queries
from harness.memory_service import MemoryServiceProcess
from harness.servers import Replicas, compactions, memory_service_replicas, wait_for_compactions
from inference_node.query_embedding import LocalQueryEmbedder
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import REPLICA_OPTIONS
from inferscale_kv.profile import kv_profile_id

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _profile() -> pb.KvProfile:
    profile = pb.KvProfile(model="bench", model_hash="mh", kv_dtype="bfloat16", tokenizer_hash="th", header_hash="hh",
                           recipe="chunked-rope-cwe", recipe_version=1, context_window=0)
    profile.profile_id = kv_profile_id(profile)
    return profile


def _stat_cpu_seconds(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def cpu_seconds(pid: int) -> float:
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def service_counter(service: MemoryServiceProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10) as response:
        return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))


def server_cpu_seconds(command: str) -> float:
    """CPU seconds of the live processes named `command` (PostgreSQL's postmaster and its backends, SeaweedFS's
    `weed`): this benchmark runs one server of each."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended
            continue
        if text[text.index("(") + 1:text.rindex(")")] == command:
            total += _stat_cpu_seconds(text)
    return total


def totals(deployed: Replicas) -> dict[str, float]:
    """The replicas' CPU seconds and coordination statements so far, the store's S3 requests, and the CPU seconds
    of the database and object-store servers (0 on the embedded defaults, which have none)."""
    s3 = deployed.s3
    shared = s3 is not None
    return {"cpu_s": sum(cpu_seconds(s.pid) for s in deployed.services),
            "statements": sum(service_counter(s, "inferscale_coordination_statements_total")
                              for s in deployed.services),
            "s3_requests": s3.requests_served() if s3 is not None else 0.0,
            "postgres_cpu_s": server_cpu_seconds("postgres") if shared else 0.0,
            "object_store_cpu_s": server_cpu_seconds("weed") if shared else 0.0}


def user_name(index: int) -> str:
    return f"bench-{index:04d}"


def populate(stub, users: int, facts_per_user: int) -> None:
    for index in tqdm(range(users), desc="ingesting users", unit="user"):
        facts = [pb.FactInput(text=text) for text in synthetic_facts(facts_per_user, 3000 + index)]
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user_name(index), facts=facts), timeout=600)


def per_call_costs(deployed: Replicas, stub, users: list[int], queries: list[str], vectors: dict[str, list[float]],
                   model_id: str, warm: bool) -> dict:
    """Mean costs of one RetrieveAndStage per user of `users` (warm: each user searched once before measuring)."""
    profile = _profile()

    def request(index: int, query: str) -> pb.RetrieveAndStageRequest:
        message = pb.RetrieveAndStageRequest(user_id=user_name(index), query=query, top_k=20, profile=profile,
                                             node_id="bench")
        if vectors:
            message.query_vector.extend(vectors[query])
            message.embedding_model_id = model_id
        return message

    if warm:
        for index in users:
            stub.RetrieveAndStage(request(index, queries[0]), timeout=60)
    before = totals(deployed)
    for index, query in zip(users, queries[1:], strict=False):
        stub.RetrieveAndStage(request(index, query), timeout=60)
    after = totals(deployed)
    calls = min(len(users), len(queries) - 1)
    per_call = {}
    for name in before:  # CPU seconds become milliseconds per call
        delta = (after[name] - before[name]) / calls
        per_call[name.removesuffix("_s") + "_ms" if name.endswith("cpu_s") else name] = \
            delta * 1000 if name.endswith("cpu_s") else delta
    return per_call | {"calls": calls}


async def latency(deployed: Replicas, users: int, queries: list[str], callers: int, seconds: float) -> dict:
    profile = _profile()
    latencies: list[float] = []
    errors: list[str] = []  # status code names
    async with grpc.aio.insecure_channel(deployed.address, options=REPLICA_OPTIONS) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)

        async def caller(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    await stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
                        user_id=user_name(rng.randrange(users)), query=rng.choice(queries), top_k=20,
                        profile=profile, node_id="bench"), timeout=30)
                    latencies.append((time.perf_counter() - started) * 1000)
                except grpc.aio.AioRpcError as error:
                    errors.append(error.code().name)

        # Every replica's search cache holds every user first (round robin spreads a user's calls over all of
        # them), as in steady state; cold reads are priced by per_call_costs.
        for index in range(users * len(deployed.services)):
            await stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
                user_id=user_name(index % users), query=queries[0], top_k=20, profile=profile, node_id="bench"),
                timeout=60)
        deadline = time.monotonic() + seconds
        started = time.perf_counter()
        await asyncio.gather(*(caller(seed) for seed in range(callers)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {"calls": len(latencies), "errors": len(errors), "throughput_rps": round(len(latencies) / wall, 1),
            "p50_ms": round(latencies[len(latencies) // 2], 2),
            "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 2),
            "mean_ms": round(statistics.fmean(latencies), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=120)
    parser.add_argument("--facts-per-user", type=int, default=100)
    parser.add_argument("--calls", type=int, default=100, help="per-call cost samples per (setup, cache, embedding)")
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--optimize-interval-s", type=float, default=10.0,
                        help="the services' compaction interval; costs are measured after a compaction")
    parser.add_argument("--output", type=Path, default=Path("results/replicas"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    queries = synthetic_queries(args.calls + 1, seed=77)
    embedder = LocalQueryEmbedder("all-MiniLM-L6-v2")
    vectors = {query: asyncio.run(embedder.embed(query))[0] for query in queries}
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "costs": {}, "latency": {}}
    setups = [("embedded, 1 replica", 1, False), ("PostgreSQL + S3, 1 replica", 1, True),
              ("PostgreSQL + S3, 3 replicas", 3, True)]
    for name, replicas, shared in setups:
        with tempfile.TemporaryDirectory(prefix="inferscale-replicas-") as workdir, \
                memory_service_replicas(Path(workdir), replicas, "--embedding-threads", "1", "--optimize-interval-s",
                                        str(args.optimize_interval_s), shared=shared, bucket="bench") as deployed:
            with grpc.insecure_channel(deployed.services[0].address) as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                compacted = [compactions(deployed.services[0])]
                populate(stub, args.users, args.facts_per_user)
                wait_for_compactions(deployed.services[:1], compacted)  # steady state: the import compacted
                model_id = stub.GetStats(pb.GetStatsRequest()).embedding_model_id
                if replicas == 1:
                    half = args.users // 2
                    cold = list(range(half, args.users))
                    results["costs"][name] = {
                        "cached, service embeds": per_call_costs(deployed, stub, list(range(half))[: args.calls],
                                                                 queries, {}, model_id, warm=True),
                        "cached, caller embeds": per_call_costs(deployed, stub, list(range(half))[: args.calls],
                                                                queries, vectors, model_id, warm=True),
                        "uncached, service embeds": per_call_costs(deployed, stub, cold[: len(cold) // 2], queries,
                                                                   {}, model_id, warm=False),
                        "uncached, caller embeds": per_call_costs(deployed, stub, cold[len(cold) // 2:], queries,
                                                                  vectors, model_id, warm=False)}
            results["latency"][name] = asyncio.run(latency(deployed, args.users, queries, args.callers, args.seconds))
            (args.output / "results.json").write_text(json.dumps(results, indent=2))
    report = markdown(results)
    (args.output / "report.md").write_text(report)
    print(report)


def markdown(results: dict) -> str:
    lines = ["| setup | user | query embedded by | service CPU ms/call | coordination statements/call | "
             "object-store requests/call | PostgreSQL CPU ms/call | object-store CPU ms/call |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for setup, rows in results["costs"].items():
        for label, row in rows.items():
            cache, embedder = label.split(", ")
            lines.append(f"| {setup} | {cache} | {embedder.removesuffix(' embeds')} | {row['cpu_ms']:.2f} | "
                         f"{row['statements']:.2f} | {row['s3_requests']:.2f} | {row['postgres_cpu_ms']:.3f} | "
                         f"{row['object_store_cpu_ms']:.3f} |")
    lines += ["", "| setup | callers | req/s | p50 ms | p99 ms | errors |", "|---|---:|---:|---:|---:|---:|"]
    for setup, row in results["latency"].items():
        lines.append(f"| {setup} | {results['args']['callers']} | {row['throughput_rps']} | {row['p50_ms']} | "
                     f"{row['p99_ms']} | {row['errors']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
