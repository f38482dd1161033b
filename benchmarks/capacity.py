"""Capacity model of the memory service's shared deployment, from the per-call costs `benchmarks.replicas` measured.

    python -m benchmarks.capacity [--replicas-results results/replicas/results.json] [--calls-per-s 10000]
                                  [--facts 100e6] [--top-k 20] [--kv-miss-rate 0.1]

Per RetrieveAndStage the measured costs (service CPU, PostgreSQL statements and CPU, object-store requests and CPU;
for a user the replica has cached and one it has not; the query embedded by the service or by the caller) are
scaled to --calls-per-s. Storage and KV traffic are computed from the KV shape (Llama-3-8B: 32 layers x 8 KV heads
x 128 dims, K and V, fp8: 65,536 bytes per token) and the mean fact length: one object-store GET per fact blob a
replica's host tier misses, and the blob's bytes moved to the node. Every figure the model assumes rather than
measures is a flag, printed with the result.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SHARED_SETUP = "PostgreSQL + S3, 1 replica"
SCENARIOS = ("cached, caller embeds", "cached, service embeds", "uncached, caller embeds", "uncached, service embeds")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return layers * kv_heads * head_dim * 2 * dtype_bytes  # K and V


def model(costs: dict[str, dict[str, float]], args: argparse.Namespace) -> dict:
    per_token = kv_bytes_per_token(args.layers, args.kv_heads, args.head_dim, args.kv_dtype_bytes)
    fact_bytes = per_token * args.tokens_per_fact
    rate = args.calls_per_s
    scenarios = {}
    for name in SCENARIOS:
        row = costs[name]
        service_cores = rate * row["cpu_ms"] / 1000
        postgres_cores = rate * row["postgres_cpu_ms"] / 1000
        scenarios[name] = {
            "service_cores": service_cores,
            "replicas": math.ceil(service_cores / (args.cores_per_replica * args.target_utilization)),
            "postgres_statements_per_s": rate * row["statements"],
            "postgres_cores": postgres_cores,
            # One PostgreSQL primary takes every call's statements: the rate its cores allow.
            "postgres_max_calls_per_s": args.postgres_cores * args.target_utilization * 1000 / row["postgres_cpu_ms"]
            if row["postgres_cpu_ms"] > 0 else math.inf,
            "object_store_requests_per_s": rate * row["s3_requests"],
            "object_store_cores": rate * row["object_store_cpu_ms"] / 1000,
        }
    kv_gets = rate * args.top_k * args.kv_miss_rate
    return {
        "assumptions": {key: value for key, value in vars(args).items() if key != "replicas_results"},
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_fact": fact_bytes,
        "stored": {"fact_kv_bytes": args.facts * fact_bytes,
                   "kv_index_bytes": args.facts * args.index_bytes_per_fact,
                   "lancedb_bytes": args.facts * args.lancedb_bytes_per_fact},
        "per_call_miss": {"kv_bytes": args.top_k * fact_bytes, "object_store_gets": args.top_k},
        "kv_misses": {"object_store_gets_per_s": kv_gets, "bytes_per_s": kv_gets * fact_bytes,
                      "node_nics": kv_gets * fact_bytes * 8 / (args.nic_gbit * 1e9 * args.target_utilization)},
        "scenarios": scenarios,
    }


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def markdown(result: dict) -> str:
    a = result["assumptions"]
    stored, miss, misses = result["stored"], result["per_call_miss"], result["kv_misses"]
    lines = [f"At {a['calls_per_s']:,.0f} RetrieveAndStage calls/s ({a['cores_per_replica']}-core replicas and a "
             f"{a['postgres_cores']}-core PostgreSQL primary run to {a['target_utilization']:.0%}):", "",
             "| scenario | service cores | replicas | PostgreSQL statements/s | PostgreSQL cores | calls/s one "
             "primary takes | object-store requests/s (LanceDB) | object-store cores |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in result["scenarios"].items():
        lines.append(f"| {name} | {row['service_cores']:.1f} | {row['replicas']} | "
                     f"{row['postgres_statements_per_s']:,.0f} | {row['postgres_cores']:.1f} | "
                     f"{row['postgres_max_calls_per_s']:,.0f} | {row['object_store_requests_per_s']:,.0f} | "
                     f"{row['object_store_cores']:.1f} |")
    lines += ["", f"KV: {result['kv_bytes_per_token']:,} bytes per token ({a['layers']} layers x {a['kv_heads']} KV "
              f"heads x {a['head_dim']} x K,V x {a['kv_dtype_bytes']} byte), {a['tokens_per_fact']} tokens per "
              f"fact: {_si(result['kv_bytes_per_fact'], 'B')} per fact.",
              f"Stored for {a['facts']:,.0f} facts: fact KV {_si(stored['fact_kv_bytes'], 'B')} (object store), "
              f"KV index {_si(stored['kv_index_bytes'], 'B')} (PostgreSQL), facts and embeddings "
              f"{_si(stored['lancedb_bytes'], 'B')} (LanceDB).",
              f"A call whose {a['top_k']} facts all miss the replica's host tier: {miss['object_store_gets']} "
              f"object-store GETs, {_si(miss['kv_bytes'], 'B')} moved to the node.",
              f"At a {a['kv_miss_rate']:.0%} fact miss rate: {misses['object_store_gets_per_s']:,.0f} GETs/s, "
              f"{_si(misses['bytes_per_s'], 'B')}/s, {misses['node_nics']:.1f} {a['nic_gbit']:.0f} Gbit/s NICs' "
              "worth."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas-results", type=Path, default=Path("results/replicas/results.json"))
    parser.add_argument("--calls-per-s", type=float, default=10_000)
    parser.add_argument("--facts", type=float, default=100e6)
    parser.add_argument("--top-k", type=int, default=20, help="facts per call (the node's default)")
    parser.add_argument("--tokens-per-fact", type=float, default=18.6,
                        help="mean fact length (LoCoMo observations, measured in the dev6 KV index)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-dtype-bytes", type=int, default=1, help="1: fp8")
    parser.add_argument("--index-bytes-per-fact", type=float, default=304,
                        help="KV index row with its token ids (measured: the dev6 SQLite index, bytes / rows)")
    parser.add_argument("--lancedb-bytes-per-fact", type=float, default=1_800,
                        help="384-dim float32 embedding, text, ids and timestamps")
    parser.add_argument("--kv-miss-rate", type=float, default=0.1,
                        help="fraction of retrieved facts read from the object store (missing both the node "
                             "cache and the replica's host tier)")
    parser.add_argument("--cores-per-replica", type=int, default=2)
    parser.add_argument("--postgres-cores", type=int, default=16)
    parser.add_argument("--nic-gbit", type=float, default=25)
    parser.add_argument("--target-utilization", type=float, default=0.6)
    args = parser.parse_args()
    results = json.loads(args.replicas_results.read_text())
    result = model(results["costs"][SHARED_SETUP], args)
    output = args.replicas_results.parent
    (output / "capacity.json").write_text(json.dumps(result, indent=2, default=str))
    report = markdown(result)
    (output / "capacity.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
