"""Memory service benchmark: ingest throughput and SearchFacts latency for small and large per-user sets.

    python -m benchmarks.memory_service [--small-users 50] [--large-users 2] [--queries 200]
        [--retrieval vector keyword hybrid]

Starts a real memory service (LanceDB + all-MiniLM-L6-v2) in a temporary directory, ingests synthetic facts
for users with 100 facts and users with 10,000 facts, then times SearchFacts at top_k=50 from one client, each
query asked in every retrieval mode in turn (the modes interleaved, their order rotating, so that a noisy machine
weighs on each alike). Prints a markdown table and writes JSON (default results/memory_service.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.stats import percentiles_ms
from benchmarks.synthetic import synthetic_facts, synthetic_queries
from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc


def _ingest(stub, users: list[str], facts_per_user: int, batch: int, clients: int, desc: str) -> tuple[int, float]:
    jobs = [
        (user, index, facts[start : start + batch])
        for index, user in enumerate(users)
        for facts in [synthetic_facts(facts_per_user, seed=zlib.crc32(user.encode()))]
        for start in range(0, facts_per_user, batch)
    ]

    def run(job) -> int:
        user, _, texts = job
        request = pb.IngestFactsRequest(user_id=user, facts=[pb.FactInput(text=text) for text in texts])
        stub.IngestFacts(request, timeout=600)
        return len(texts)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool, tqdm(total=len(users) * facts_per_user, desc=desc,
                                                               unit="fact") as progress:
        for done in pool.map(run, jobs):
            progress.update(done)
    return len(users) * facts_per_user, time.perf_counter() - started


RETRIEVAL_MODES = {"vector": pb.RETRIEVAL_MODE_VECTOR, "keyword": pb.RETRIEVAL_MODE_KEYWORD,
                   "hybrid": pb.RETRIEVAL_MODE_HYBRID}


def _search_latencies(stub, users: list[str], queries: int, top_k: int, modes: list[str],
                      desc: str) -> dict[str, list[float]]:
    """Each mode's SearchFacts latencies over the same queries, the modes interleaved."""
    rng = random.Random(7)
    texts = synthetic_queries(queries, seed=11)
    latencies: dict[str, list[float]] = {mode: [] for mode in modes}
    for index, text in enumerate(tqdm(texts, desc=desc, unit="query")):
        user = rng.choice(users)
        for mode in modes[index % len(modes):] + modes[: index % len(modes)]:
            request = pb.SearchFactsRequest(user_id=user, query=text, top_k=top_k, retrieval=RETRIEVAL_MODES[mode])
            started = time.perf_counter()
            response = stub.SearchFacts(request)
            latencies[mode].append(time.perf_counter() - started)
            assert len(response.facts) == top_k or mode == "keyword"  # keyword: the facts sharing a word only
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-users", type=int, default=50, help="users with 100 facts each")
    parser.add_argument("--large-users", type=int, default=2, help="users with 10,000 facts each")
    parser.add_argument("--queries", type=int, default=200, help="SearchFacts calls per size class")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--batch", type=int, default=500, help="facts per IngestFacts call")
    parser.add_argument("--clients", type=int, default=2, help="concurrent ingest clients")
    parser.add_argument("--retrieval", nargs="+", choices=list(RETRIEVAL_MODES), default=list(RETRIEVAL_MODES),
                        help="retrieval modes timed")
    parser.add_argument("--output", type=Path, default=Path("results/memory_service.json"))
    args = parser.parse_args()

    classes = {100: [f"small-{i}" for i in range(args.small_users)],
               10_000: [f"large-{i}" for i in range(args.large_users)]}
    rows: dict[str, dict[str, Any]] = {}  # facts per user -> figures
    with tempfile.TemporaryDirectory(prefix="inferscale-bench-") as workdir:
        service = MemoryServiceProcess(Path(workdir) / "data", Path(workdir) / "service.log").start()
        try:
            with service.channel() as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                for facts_per_user, users in classes.items():
                    if not users:
                        continue
                    count, elapsed = _ingest(stub, users, facts_per_user, min(args.batch, facts_per_user),
                                             args.clients, f"ingest {facts_per_user}/user")
                    latencies = _search_latencies(stub, users, args.queries, args.top_k, args.retrieval,
                                                  f"search {facts_per_user}/user")
                    rows[str(facts_per_user)] = {
                        "users": len(users), "facts": count, "ingest_s": elapsed,
                        "ingest_facts_per_s": count / elapsed,
                        "search_ms": {mode: percentiles_ms(samples) for mode, samples in latencies.items()},
                    }
                table_facts = stub.GetStats(pb.GetStatsRequest()).facts
        finally:
            service.stop()

    results = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "top_k": args.top_k,
               "classes": rows, "table_facts": table_facts}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"\n| facts/user | users | ingest facts/s | retrieval | SearchFacts p50 ms | p90 ms | p99 ms | "
          f"(top_k={args.top_k}, {table_facts} facts in table)\n|---:|---:|---:|---|---:|---:|---:|")
    for size, row in rows.items():
        for mode, search in row["search_ms"].items():
            print(f"| {size} | {row['users']} | {row['ingest_facts_per_s']:.0f} | {mode} | {search['p50']:.1f} | "
                  f"{search['p90']:.1f} | {search['p99']:.1f} |")
    print(f"\nJSON: {args.output}")


if __name__ == "__main__":
    main()
