"""The node's byte path on a node-cache miss: fact KV from the memory service into host tensors at the node, in GB/s
and CPU seconds per GB, from the service's host cache and from its durable tier, with the service on a directory or
on S3 (SeaweedFS on this machine).

    python -m benchmarks.byte_path [--store dir s3] [--users 2] [--facts-per-user 30] [--k 20] [--streams 1 4]
        [--callers 1 2] [--duration-s 6] [--fetch-process] [--legacy] [--durable-reads]

For each store: starts a memory service, has the synthetic worker compute Llama-3-8B-shaped bf16 KV (~4.4 MiB per
fact) for every user's facts, asks RetrieveAndStage for each user's top k (as a node does) and then, per phase, runs
`--callers` closed loops of fetches for `--duration-s`, each fetch the header and the k facts of a random user
decoded into bf16 host tensors of every head (as MemoryServiceKv hands them to the node's tiers). Phases:
`host` (the service's default host cache, warmed first) and `durable` (the same data, the service restarted with
--kv-host-budget-mb 0: every blob read from the directory or the bucket; a directory's files sit in the OS page
cache, so this is the service's read path, not the disk). `--streams` are MemoryServiceKv's concurrent FetchKv
calls per fetch, in this process; `--fetch-process` adds the serving path, the same fetch in a fetch process
(inference_node.fetch_process) handing its decoded heads over through shared memory, copied out here; `--legacy` adds
the path before (one FetchKv, each reply parsed into a protobuf message, the blob copied by decode_kv_blob, then the
heads copied); `--durable-reads` adds the node reading each blob from the service's durable tier itself (the
directory, or the bucket with the service's credentials standing for a read-only key: --kv-durable-tier), in this
process and with `--fetch-process` in a fetch process. CPU seconds count the node (this process, which stands for
vLLM's engine process, and the fetch process), the service and SeaweedFS.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import psutil
import torch

from benchmarks.dummy_model import SHAPES, build_dummy_model
from benchmarks.memory_step import populate
from demo.smollm2 import build_smollm2
from harness.memory_service import MemoryServiceProcess
from harness.servers import S3Endpoint, postgres_server, seaweedfs_s3
from inference_node.durable_blobs import durable_blobs
from inference_node.fetch_process import FetchProcessKv
from inference_node.kv_fetch import CachedKv, MemoryServiceKv
from inference_node.plan import ChunkLoad
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import decode_kv_blob
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, KvKey
from inferscale_kv.layout import memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from inferscale_kv.shape import KvShape

REPO_ROOT = Path(__file__).resolve().parents[1]
Fetch = Callable[[str, list[ChunkLoad]], list[CachedKv]]
NodePids = Callable[[], list[int]]  # the node's processes besides this one (a fetch process)


def legacy_fetch(address: str) -> Fetch:
    """The path before: one FetchKv call, every reply a parsed protobuf message, decode_kv_blob (a copy), the heads
    sliced and copied (kv_source.MemoryServiceKv as of commit 857e744)."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)])
    stub = memory_pb2_grpc.MemoryServiceStub(channel)

    def fetch(user_id: str, chunks: list[ChunkLoad]) -> list[CachedKv]:
        header, facts = chunks[0], chunks[1:]
        request = pb.FetchKvRequest(profile_id=header.key.profile_id, user_id=user_id, include_header=True,
                                    header_content_id=header.key.content_id,
                                    facts=[pb.FactRef(fact_id=c.key.fact_id, version=c.key.version,
                                                      content_id=c.key.content_id) for c in facts])
        out = []
        for chunk, reply in zip(chunks, list(stub.FetchKv(request, timeout=60)), strict=True):
            kv = decode_kv_blob(reply.blob, torch.bfloat16)
            assert kv.header.key == chunk.key and kv.header.token_ids == chunk.token_ids
            out.append(CachedKv(kv.keys[:, :, :].contiguous(), kv.values[:, :, :].contiguous(), kv.header.token_ids))
        return out

    return fetch


def new_fetch(address: str, durable_tier: str, streams: int) -> tuple[Fetch, NodePids]:
    source = MemoryServiceKv(address, 60, slice(None), streams=streams, durable=durable_blobs(durable_tier))
    return (lambda user_id, chunks: source.fetch(user_id, chunks, torch.bfloat16)), list


def process_fetch(address: str, durable_tier: str, shape: KvShape) -> tuple[Fetch, NodePids]:
    source = FetchProcessKv(address, 60, slice(0, shape.num_kv_heads), shape, durable_tier=durable_tier)
    return ((lambda user_id, chunks: source.fetch(user_id, chunks, torch.bfloat16)),
            lambda: [pid] if (pid := source.process_id) is not None else [])


def legacy(address: str, durable_tier: str) -> tuple[Fetch, NodePids]:
    return legacy_fetch(address), list


def fetch_plan(service: MemoryServiceProcess, users: list[str], profile: pb.KvProfile, k: int,
               header_ids: tuple[int, ...]) -> dict[str, tuple[list[ChunkLoad], int]]:
    """Each user's chunks as a node asks for them after RetrieveAndStage (header first), and their blob bytes."""
    plan = {}
    with grpc.insecure_channel(service.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        for user in users:
            response = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
                user_id=user, query="what does the user like", top_k=k, profile=profile, node_id="byte-path"),
                timeout=60)
            if not response.header_content_id or not all(fact.kv_ready for fact in response.facts):
                raise RuntimeError(f"{user}: KV not ready")
            chunks = [ChunkLoad(KvKey(profile.profile_id, HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION,
                                      response.header_content_id), header_ids, 0)]
            chunks += [ChunkLoad(KvKey(profile.profile_id, user, fact.fact_id, fact.version, fact.content_id),
                                 tuple(fact.token_ids), 0) for fact in response.facts]
            plan[user] = (chunks, sum(fact.kv_bytes for fact in response.facts))
    return plan


def cpu_seconds(node_pids: list[int], pids: list[int]) -> tuple[float, float, float]:
    """CPU seconds of this process (every thread: the engine's side of the node), of the node's other processes
    `node_pids`, and of the processes `pids` and their children (the service's side)."""
    own = resource.getrusage(resource.RUSAGE_SELF)

    def total(roots: list[int]) -> float:
        seconds = 0.0
        for pid in roots:
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(pid)
                for each in [process, *process.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        times = each.cpu_times()
                        seconds += times.user + times.system
        return seconds

    return own.ru_utime + own.ru_stime, total(node_pids), total(pids)


def run_phase(fetch: Fetch, node_pids: NodePids, plan: dict[str, tuple[list[ChunkLoad], int]], callers: int,
              duration_s: float, pids: list[int]) -> dict[str, Any]:
    users = sorted(plan)
    fetch(users[0], plan[users[0]][0])  # warm-up (connections, the host cache)
    moved, latencies, lock = [0], [], threading.Lock()
    deadline = time.monotonic() + duration_s

    def loop(index: int) -> None:
        rng = random.Random(index)
        while time.monotonic() < deadline:
            user = rng.choice(users)
            chunks, _ = plan[user]
            started = time.perf_counter()
            fetched = fetch(user, chunks)
            elapsed = time.perf_counter() - started
            with lock:
                moved[0] += sum(entry.nbytes for entry in fetched)
                latencies.append(elapsed * 1000)

    cpu_before, started = cpu_seconds(node_pids(), pids), time.perf_counter()
    threads = [threading.Thread(target=loop, args=(index,)) for index in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu_after = time.perf_counter() - started, cpu_seconds(node_pids(), pids)
    engine_cpu, fetch_process_cpu, service_cpu = (
        after - before for after, before in zip(cpu_after, cpu_before, strict=True))
    node_cpu = engine_cpu + fetch_process_cpu
    gigabytes = moved[0] / 1e9
    return {"callers": callers, "fetches": len(latencies), "mb_per_fetch": round(moved[0] / len(latencies) / 1e6, 1),
            "gb_per_s": round(gigabytes / wall, 3), "cpu_s_per_gb": round((node_cpu + service_cpu) / gigabytes, 2),
            "node_cpu_s_per_gb": round(node_cpu / gigabytes, 2),
            "engine_cpu_s_per_gb": round(engine_cpu / gigabytes, 2),
            "service_cpu_s_per_gb": round(service_cpu / gigabytes, 2), "p50_ms": round(statistics.median(latencies), 1)}


@contextlib.contextmanager
def store(kind: str, root: Path) -> Iterator[tuple[list[str], dict[str, str], S3Endpoint | None]]:
    """The service's flags and environment for `kind`, with SeaweedFS (and the PostgreSQL a shared store needs)
    running for s3."""
    if kind == "dir":
        yield [], {}, None
        return
    # Postgres's CPU is not counted: it answers the index queries, the same for every path.
    with postgres_server(root / "postgres") as url, seaweedfs_s3(root / "s3") as s3:
        s3.create_bucket("bytepath")
        yield ["--coordination-url", url, "--store-uri", "s3://bytepath/service", "--s3-endpoint", s3.url,
               "--s3-allow-http"], s3.environment(), s3


def weed_pids() -> list[int]:
    return [process.pid for process in psutil.process_iter(["name"]) if process.info["name"] == "weed"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.byte_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", nargs="+", choices=("dir", "s3"), default=["dir", "s3"])
    parser.add_argument("--users", type=int, default=2)
    parser.add_argument("--facts-per-user", type=int, default=30)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4],
                        help="MemoryServiceKv's concurrent FetchKv calls per fetch (one phase each)")
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 2], help="concurrent fetches")
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument("--tiers", nargs="+", choices=("host", "durable"), default=["host", "durable"])
    parser.add_argument("--fetch-process", action="store_true",
                        help="also measure the serving path: the fetch in a fetch process, shared memory")
    parser.add_argument("--legacy", action="store_true", help="also measure the path before (one stream, protobuf)")
    parser.add_argument("--durable-reads", action="store_true",
                        help="also measure the node reading the service's durable tier itself (--kv-durable-tier), "
                        "in this process and, with --fetch-process, in a fetch process")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "byte_path.json")
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    tokenizer_dir = build_smollm2(REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
    users = [f"byte-user-{index:02d}" for index in range(args.users)]
    results: dict[str, Any] = {"args": {key: str(value) for key, value in vars(args).items()},
                               "date": datetime.now(UTC).isoformat(timespec="seconds"),
                               "cpus": psutil.cpu_count(), "phases": []}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # Each path: (name, reads the durable tier itself, make(address, durable tier location)).
    paths: list[tuple[str, bool, Callable[[str, str], tuple[Fetch, NodePids]]]] = [
        (f"streams={streams}", False, functools.partial(new_fetch, streams=streams)) for streams in args.streams]
    if args.legacy:
        paths.insert(0, ("legacy", False, legacy))
    if args.durable_reads:
        paths.append(("durable tier, in process", True, functools.partial(new_fetch, streams=1)))
    with tempfile.TemporaryDirectory(prefix="byte-path-") as scratch:
        work = Path(scratch)
        model_dir = build_dummy_model(work / args.shape, args.shape, tokenizer_dir, "bfloat16")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        profile = pb.KvProfile(**build_model_profile(model_dir, tokenizer, "bfloat16",
                                                     DEFAULT_CONTEXT_WINDOW).as_dict())
        header_ids = tuple(memory_header_ids(tokenizer))
        if args.fetch_process:
            shape = KvShape.from_config(AutoConfig.from_pretrained(model_dir))
            paths.append(("fetch process", False, functools.partial(process_fetch, shape=shape)))
            if args.durable_reads:
                paths.append(("durable tier, fetch process", True, functools.partial(process_fetch, shape=shape)))
        for kind in args.store:
            with store(kind, work) as (flags, env, s3):
                data = work / f"data-{kind}"
                # Where the service keeps its durable tier, as a node's --kv-durable-tier names it (for a bucket, the
                # endpoint and credentials from the environment, which the fetch process inherits).
                durable_tier = str(data / "kv" / "blobs") if s3 is None else "s3://bytepath/service/kv"
                if s3 is not None:
                    os.environ.update({**env, "AWS_ENDPOINT_URL": s3.url, "AWS_DEFAULT_REGION": "us-east-1"})
                for tier in args.tiers:
                    tier_flags = ["--kv-host-budget-mb", "0"] if tier == "durable" else []
                    service = MemoryServiceProcess(data, work / f"{kind}-{tier}.log", *flags, *tier_flags,
                                                   env=env).start()
                    try:
                        if tier == args.tiers[0]:
                            populate(service, model_dir, users, args.facts_per_user, 2, "bfloat16", env)
                        plan = fetch_plan(service, users, profile, args.k, header_ids)
                        pids = [service.pid, *(weed_pids() if kind == "s3" else [])]
                        for name, direct, make in paths:
                            fetch, node_pids = make(service.address, durable_tier if direct else "")
                            for callers in args.callers:
                                phase = {"store": kind, "tier": tier, "path": name,
                                         **run_phase(fetch, node_pids, plan, callers, args.duration_s, pids)}
                                results["phases"].append(phase)
                                args.output.write_text(json.dumps(results, indent=2))
                                print(json.dumps(phase), flush=True)
                    finally:
                        service.stop()
    print("\n| store | tier | path | callers | MB/fetch | GB/s | CPU s/GB (node + service) | engine process CPU s/GB "
          "| p50 ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for phase in results["phases"]:
        print(f"| {phase['store']} | {phase['tier']} | {phase['path']} | {phase['callers']} | "
              f"{phase['mb_per_fetch']} | {phase['gb_per_s']} | {phase['cpu_s_per_gb']} "
              f"({phase['node_cpu_s_per_gb']} + {phase['service_cpu_s_per_gb']}) | {phase['engine_cpu_s_per_gb']} | "
              f"{phase['p50_ms']} |")
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
