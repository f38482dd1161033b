"""The memory step under load: RetrieveAndStage (and the FetchKv a node makes on a node-cache miss) from many
concurrent callers against a real memory service holding Llama-3-8B-sized fact KV.

    python -m benchmarks.memory_step [--users 16] [--facts-per-user 50] [--k 50] [--callers 1 8 64]
        [--duration-s 15] [--kv-host-budget-mb 1024] [--embeds service caller] [--fetch] [--replicas 1 4 8]

Starts the memory service (`--replicas`: as many replicas as the largest value, on a real PostgreSQL and SeaweedFS
when it is above 1 or with `--shared-stores`; each set of phases spreads its calls round robin over the first n),
gives each user `--facts-per-user` facts, has the synthetic worker compute their KV at the
`--shape` (random bf16 KV of Llama-3-8B's shape by default: ~4.4 MiB per fact of 2 clauses), then, for each number
of callers, runs a closed loop of RetrieveAndStage calls at top_k=k with the exact KvProfile a node of that shape
announces, each call for a random user and question, with the query's text (the service embeds it) or its vector
(embedded beforehand, as a node with --embed-queries-locally sends it: `--embeds caller`). A call keeps its memory
when it answers with k facts whose KV is ready; one that does not is counted apart (never in the latency figures).
With `--fetch` every call is followed by the FetchKv of its facts, as a node whose cache lacks them would make.
Reports calls/s, p50/p99, the CPU per call of the replicas and of PostgreSQL (/proc), and the KV work per call read
off the service's metrics (KV bytes read by source, durable-tier lookups). `--service-source DIR` runs the service
from another checkout (the same benchmark before and after a change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from benchmarks.dummy_model import SHAPES, build_dummy_model
from benchmarks.replicas import totals
from benchmarks.synthetic import synthetic_facts, synthetic_queries
from demo.smollm2 import build_smollm2
from harness.memory_service import MemoryServiceProcess
from harness.servers import Replicas, memory_service_replicas
from inference_node.retrieval import RetrievalBatcher
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import REPLICA_OPTIONS
from inferscale_kv.layout import memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW

REPO_ROOT = Path(__file__).resolve().parents[1]
# The callers' channels: round robin over the replicas, as a node's, taking large FetchKv answers.
CHANNEL_OPTIONS = (*REPLICA_OPTIONS, ("grpc.max_receive_message_length", 256 << 20))
# Service counters that tell the KV work behind the calls (summed over their labels unless a label is named).
DURABLE_TIERS = ("disk", "object-store")
WORK_COUNTERS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "durable_lookups": ("inferscale_kv_tier_lookups", {"tier": DURABLE_TIERS}),
    "durable_bytes_read": ("inferscale_kv_bytes_read", {"tier": DURABLE_TIERS}),
    "host_bytes_read": ("inferscale_kv_bytes_read", {"tier": ("host",)}),
    "bytes_served": ("inferscale_kv_bytes_served", {}),
}


@dataclass
class PhaseResult:
    callers: int
    embeds: str = "service"
    replicas: int = 1
    calls: int = 0
    kept: int = 0
    lost: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)  # RetrieveAndStage, of the calls that kept their memory
    fetch_latencies_ms: list[float] = field(default_factory=list)  # the FetchKv after it (--fetch)
    wall_s: float = 0.0
    work: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies_ms)

        def quantile(q: float, values: list[float] = ordered) -> float | None:
            return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None

        fetches = sorted(self.fetch_latencies_ms)

        per_call = {name: round(self.work[name] / self.calls, 1) if self.calls else None for name in WORK_COUNTERS
                    if name in self.work}

        def cpu_ms_per_call(name: str) -> float | None:
            return round(self.work[name] * 1000 / self.calls, 3) if self.calls and name in self.work else None

        return {"replicas": self.replicas, "embeds": self.embeds, "callers": self.callers, "calls": self.calls,
                "calls_per_s": round(self.calls / self.wall_s, 1),
                "p50_ms": quantile(0.5), "p99_ms": quantile(0.99),
                "mean_ms": round(statistics.fmean(ordered), 2) if ordered else None,
                "fetch_p50_ms": quantile(0.5, fetches), "fetch_p99_ms": quantile(0.99, fetches),
                "kept_memory": self.kept, "lost_memory": len(self.lost), "lost_examples": self.lost[:3],
                "work_per_call": per_call, "service_cpu_ms_per_call": cpu_ms_per_call("service_cpu_s"),
                "postgres_cpu_ms_per_call": cpu_ms_per_call("postgres_cpu_s")}


def service_counters(metrics_port: int) -> dict[str, float]:
    """The WORK_COUNTERS' current values, read from the service's /metrics (0 for a counter it does not export)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = dict.fromkeys(WORK_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for name, (metric, labels) in WORK_COUNTERS.items():
            if family.name != metric:
                continue
            for sample in family.samples:
                if sample.name.endswith("_total") and all(sample.labels.get(key) in allowed
                                                          for key, allowed in labels.items()):
                    values[name] += sample.value
    return values


async def closed_loop(stub: memory_pb2_grpc.MemoryServiceStub, requests: list[pb.RetrieveAndStageRequest],
                      callers: int, duration_s: float, k: int, fetch: bool, seed: int,
                      calls_per_caller: int | None = None, timeout_s: float = 60.0) -> PhaseResult:
    """`callers` concurrent callers, each sending its next call when the last one answered, for `duration_s` (or
    `calls_per_caller` calls each, whichever ends first); a call past `timeout_s` counts as one that lost its
    memory."""
    result = PhaseResult(callers)
    deadline = time.monotonic() + duration_s

    async def caller(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        for _ in range(calls_per_caller) if calls_per_caller is not None else iter(int, 1):
            if time.monotonic() >= deadline:
                break
            request = rng.choice(requests)
            started = time.perf_counter()
            try:
                response = await stub.RetrieveAndStage(request, timeout=timeout_s)
                elapsed_ms = (time.perf_counter() - started) * 1000
                if fetch:
                    fetch_started = time.perf_counter()
                    await fetch_facts(stub, request, response)
                    result.fetch_latencies_ms.append((time.perf_counter() - fetch_started) * 1000)
            except grpc.aio.AioRpcError as error:
                result.calls += 1
                result.lost.append(f"{request.user_id}: {error.code().name}")
                continue
            result.calls += 1
            ready = sum(1 for fact in response.facts if fact.kv_ready)
            if len(response.facts) == k and ready == k and response.header_content_id:
                result.kept += 1
                result.latencies_ms.append(elapsed_ms)
            else:
                result.lost.append(f"{request.user_id}: {len(response.facts)} facts, {ready} with KV ready")

    started = time.perf_counter()
    await asyncio.gather(*(caller(index) for index in range(callers)))
    result.wall_s = time.perf_counter() - started
    return result


async def fetch_facts(stub: memory_pb2_grpc.MemoryServiceStub, request: pb.RetrieveAndStageRequest,
                      response: pb.RetrieveAndStageResponse) -> None:
    """The FetchKv a node whose cache holds none of the call's KV makes: the header and every ready fact."""
    refs = [pb.FactRef(fact_id=fact.fact_id, version=fact.version, content_id=fact.content_id)
            for fact in response.facts if fact.kv_ready]
    fetch = pb.FetchKvRequest(profile_id=request.profile.profile_id, user_id=request.user_id, include_header=True,
                              header_content_id=response.header_content_id, facts=refs)
    replies = [reply async for reply in stub.FetchKv(fetch, timeout=60)]
    if len(replies) != len(refs) + 1 or not all(reply.blob for reply in replies):
        raise RuntimeError(f"FetchKv answered {sum(1 for r in replies if r.blob)} blobs for {len(refs) + 1}")


def query_vectors(texts: list[str]) -> tuple[list[list[float]], str]:
    """The queries embedded as a node with --embed-queries-locally would, before the run (not timed)."""
    from inference_node.query_embedding import LocalQueryEmbedder
    from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL

    embedder = LocalQueryEmbedder(DEFAULT_EMBEDDING_MODEL)

    async def embed_all() -> tuple[list[list[float]], str]:
        vectors, model_id = [], ""
        for text in texts:
            vector, model_id = await embedder.embed(text)
            vectors.append(list(vector))
        return vectors, model_id

    return asyncio.run(embed_all())


def retrieval_requests(users: list[str], questions: list[str], profile: pb.KvProfile, k: int,
                       vectors: list[list[float]], model_id: str) -> list[pb.RetrieveAndStageRequest]:
    """One RetrieveAndStage request per user and question, as a node of `profile` sends it (with the query's vector
    when `vectors` holds them, else its text)."""
    requests = []
    for user in users:
        for index, question in enumerate(questions):
            request = pb.RetrieveAndStageRequest(user_id=user, top_k=k, node_id="bench-node", profile=profile)
            if vectors:
                request.query_vector.extend(vectors[index])
                request.embedding_model_id = model_id
            else:
                request.query = question
            requests.append(request)
    return requests


def populate(service: MemoryServiceProcess, model_dir: Path, users: list[str], facts_per_user: int, clauses: int,
             kv_dtype: str, env: dict[str, str]) -> None:
    with grpc.insecure_channel(service.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        for user in tqdm(users, desc="ingest", unit="user"):
            facts = synthetic_facts(facts_per_user, seed=zlib.crc32(user.encode()), clauses=clauses)
            stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[pb.FactInput(text=text) for text in facts]),
                             timeout=600)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.synthetic_worker", "--memory-service", service.address,
                    "--model", str(model_dir), "--dtype", kv_dtype, "--kv-dtype", kv_dtype, "--exit-when-idle",
                    "--log-level", "warning"], check=True, env={**os.environ, **env})
    print(f"synthetic worker: {len(users) * facts_per_user} facts in {time.perf_counter() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--facts-per-user", type=int, default=50)
    parser.add_argument("--fact-clauses", type=int, default=2)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1],
                        help="memory-service replicas the calls are spread over, round robin, one set of phases per "
                        "value (more than one: on a real PostgreSQL and SeaweedFS, as a Kubernetes deployment runs)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes the callers are spread over (a single client saturates first)")
    parser.add_argument("--node-batching", action="store_true",
                        help="send the calls as a node does: those made while its batches are under way go together "
                        "in RetrieveAndStageBatch")
    parser.add_argument("--shared-stores", action="store_true",
                        help="run on PostgreSQL and SeaweedFS even with one replica (the same stores as the others)")
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--kv-host-budget-mb", type=int, default=None,
                        help="the service's --kv-host-budget-mb (default: the service's default)")
    parser.add_argument("--embeds", nargs="+", choices=("service", "caller"), default=["service"],
                        help="who embeds the queries: the service (text sent), the caller (vectors sent, as a node "
                        "with --embed-queries-locally)")
    parser.add_argument("--model", type=Path, default=None,
                        help="the tokenizer's model folder (default: SmolLM2-135M-Instruct, converted once)")
    parser.add_argument("--fetch", action="store_true", help="follow every call with the FetchKv of its facts")
    parser.add_argument("--service-flags", default="", help="more flags for the memory service")
    parser.add_argument("--service-source", type=Path, default=None,
                        help="run the memory service from this checkout (before/after comparisons)")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "memory_step.json")
    args = parser.parse_args()

    tokenizer_dir = args.model or build_smollm2(REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
    from transformers import AutoTokenizer

    users = [f"step-user-{index:03d}" for index in range(args.users)]
    questions = synthetic_queries(64, seed=3)
    env = {"PYTHONPATH": str(args.service_source.resolve())} if args.service_source else {}
    service_flags = args.service_flags.split()
    if args.kv_host_budget_mb is not None:
        service_flags += ["--kv-host-budget-mb", str(args.kv_host_budget_mb)]
    results: dict[str, Any] = {"args": {key: str(value) for key, value in vars(args).items()}, "phases": []}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    shared = args.shared_stores or max(args.replicas) > 1
    with tempfile.TemporaryDirectory(prefix="memory-step-") as scratch:
        work = Path(scratch)
        model_dir = build_dummy_model(work / args.shape, args.shape, tokenizer_dir, args.kv_dtype)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        profile = build_model_profile(model_dir, tokenizer, args.kv_dtype, DEFAULT_CONTEXT_WINDOW)
        assert memory_header_ids(tokenizer), "the memory header must tokenize"
        with memory_service_replicas(work / "service", max(args.replicas), *service_flags, shared=shared, env=env,
                                     source=args.service_source.resolve() if args.service_source else None
                                     ) as deployed:
            populate(deployed.services[0], model_dir, users, args.facts_per_user, args.fact_clauses, args.kv_dtype,
                     env)
            kv_profile = pb.KvProfile(**profile.as_dict())
            requests = {"service": retrieval_requests(users, questions, kv_profile, args.k, [], "")}
            if "caller" in args.embeds:
                requests["caller"] = retrieval_requests(users, questions, kv_profile, args.k,
                                                        *query_vectors(questions))
            for replicas in args.replicas:
                phase_replicas = Replicas(deployed.services[:replicas], deployed.s3, deployed.bucket)
                asyncio.run(run_phases(phase_replicas, requests, args, users, results))
    print("\n| replicas | stores | embeds | callers | calls/s | p50 ms | p99 ms | kept | lost | service CPU ms/call | "
          "PostgreSQL CPU ms/call | durable lookups/call | bytes read/call: durable | host |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for phase in results["phases"]:
        work = phase["work_per_call"]
        print(f"| {phase['replicas']} | {'shared' if shared else 'embedded'} | {phase['embeds']} | "
              f"{phase['callers']} | {phase['calls_per_s']} | {phase['p50_ms']} | {phase['p99_ms']} | "
              f"{phase['kept_memory']} | {phase['lost_memory']} | {phase['service_cpu_ms_per_call']} | "
              f"{phase['postgres_cpu_ms_per_call']} | {work['durable_lookups']} | {work['durable_bytes_read']} | "
              f"{work['host_bytes_read']} |")
    print(f"\nwritten: {args.output}")


async def run_phases(deployed: Replicas, requests: dict[str, list[pb.RetrieveAndStageRequest]],
                     args: argparse.Namespace, users: list[str], results: dict[str, Any]) -> None:
    """Every (embeds, callers) phase against `deployed`'s replicas, spread round robin as a node's channel spreads
    its calls; first, every replica has looked up every user once (its search cache holds them, as in steady
    state)."""
    for service in deployed.services:
        async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            for user in users:
                warm = next(request for request in requests[args.embeds[0]] if request.user_id == user)
                await stub.RetrieveAndStage(warm, timeout=60)
    async with grpc.aio.insecure_channel(deployed.address, options=CHANNEL_OPTIONS) as channel:
        stub = caller_stub(channel, args.node_batching)
        for embeds in args.embeds:
            await closed_loop(stub, requests[embeds], 4, 3.0, args.k, args.fetch, seed=0)  # warm-up
            for callers in args.callers:
                before = phase_counters(deployed)
                if args.client_processes > 1:
                    phase = await asyncio.to_thread(closed_loop_in_processes, deployed.address, requests[embeds],
                                                    callers, args.duration_s, args.k, args.fetch, callers,
                                                    args.client_processes, args.node_batching)
                else:
                    phase = await closed_loop(stub, requests[embeds], callers, args.duration_s, args.k, args.fetch,
                                              seed=callers)
                after = phase_counters(deployed)
                phase.embeds, phase.replicas = embeds, len(deployed.services)
                phase.work = {name: after[name] - before[name] for name in before}
                summary = phase.summary()
                results["phases"].append(summary)
                args.output.write_text(json.dumps(results, indent=2))
                print(json.dumps(summary), flush=True)


def closed_loop_in_processes(address: str, requests: list[pb.RetrieveAndStageRequest], callers: int,
                             duration_s: float, k: int, fetch: bool, seed: int, processes: int,
                             node_batching: bool) -> PhaseResult:
    """`closed_loop` split over `processes` client processes (one Python process's gRPC client tops out below the
    replicas it would measure), each with its own channel to `address`; their results merged."""
    shares = [share for index in range(processes) if (share := callers // processes + (index < callers % processes))]
    context = multiprocessing.get_context("spawn")  # not fork: this process runs gRPC's threads
    with context.Manager() as manager, ProcessPoolExecutor(max_workers=len(shares), mp_context=context) as pool:
        started = manager.Barrier(len(shares))  # every process connected before any calls: one window for all
        parts = list(pool.map(_client_process, [(address, requests, share, duration_s, k, fetch, seed * 100 + index,
                                                 started, node_batching) for index, share in enumerate(shares)]))
    merged = PhaseResult(callers)
    for part in parts:
        merged.calls += part.calls
        merged.kept += part.kept
        merged.lost += part.lost
        merged.latencies_ms += part.latencies_ms
        merged.fetch_latencies_ms += part.fetch_latencies_ms
        merged.wall_s = max(merged.wall_s, part.wall_s)
    return merged


def _client_process(job: tuple[str, list[pb.RetrieveAndStageRequest], int, float, int, bool, int, Any, bool]
                    ) -> PhaseResult:
    address, requests, callers, duration_s, k, fetch, seed, started, node_batching = job

    async def run() -> PhaseResult:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = caller_stub(channel, node_batching)
            await stub.RetrieveAndStage(requests[0], timeout=60)  # connected (each replica's subchannel comes up)
            await asyncio.to_thread(started.wait, 120)
            return await closed_loop(stub, requests, callers, duration_s, k, fetch, seed)

    return asyncio.run(run())


class _NodeBatched:
    """A stub whose RetrieveAndStage goes through a node's RetrievalBatcher (--node-batching): calls made while its
    batches are under way share RetrieveAndStageBatch RPCs."""

    def __init__(self, stub: memory_pb2_grpc.MemoryServiceStub) -> None:
        self._stub = stub
        self._batcher = RetrievalBatcher(stub, (), 60.0)

    async def RetrieveAndStage(self, request: pb.RetrieveAndStageRequest, timeout: float
                               ) -> pb.RetrieveAndStageResponse:
        return await self._batcher.call(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


def caller_stub(channel: grpc.aio.Channel, node_batching: bool) -> Any:
    """The callers' stub: the service's own, or one batching as a node does."""
    stub = memory_pb2_grpc.MemoryServiceStub(channel)
    return _NodeBatched(stub) if node_batching else stub


def phase_counters(deployed: Replicas) -> dict[str, float]:
    """The WORK_COUNTERS summed over the replicas, and the CPU seconds of the replicas and of PostgreSQL so far."""
    values = dict.fromkeys(WORK_COUNTERS, 0.0)
    for service in deployed.services:
        for name, value in service_counters(service.metrics_port).items():
            values[name] += value
    cpu = totals(deployed)
    return {**values, "service_cpu_s": cpu["cpu_s"], "postgres_cpu_s": cpu["postgres_cpu_s"]}


if __name__ == "__main__":
    main()
