"""Engine-side speed of KV injection vs text prefill, offline vLLM, synthetic fact KV (speed runs only).

    python -m benchmarks.engine_injection --shape llama3-8b --dtype bfloat16       # on a GPU (dummy weights)
    python -m benchmarks.engine_injection --model DIR --dtype float32               # any local model folder

Prompt = memory header + k facts x T tokens + a query, token ids made up (skip_tokenizer_init). The connector runs
in its synthetic mode: a fact's KV is invented on the first node-cache miss and then served from the node cache,
as in serving; no memory service is involved. Reports, side by side: single-request TTFT (prefill + first token)
for kv, text and no memory; batch throughput; and the connector's own time per request (node-cache lookup +
RoPE compose + cache writes). Writes JSON to --output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.dummy_model import LLAMA3_8B


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--shape", choices=["llama3-8b"], default=None, help="config-only model, dummy weights")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, nargs="+", default=[50])
    parser.add_argument("--tokens-per-fact", type=int, default=30)
    parser.add_argument("--header-tokens", type=int, default=40)
    parser.add_argument("--query-tokens", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="vLLM's share; the node cache of fact KV lives outside it")
    parser.add_argument("--node-cache-mb", type=int, default=24576)
    parser.add_argument("--no-load-stats", action="store_true",
                        help="skip the connector's per-phase timing (it synchronizes the device per load)")
    parser.add_argument("--pool-extra", type=int, default=10,
                        help="facts per user beyond k; each request retrieves k of them in its own order")
    parser.add_argument("--output", type=Path, default=Path("results/engine_injection.json"))
    args = parser.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    work = Path(tempfile.mkdtemp(prefix="inferscale-engine-"))
    if args.shape:
        model_dir = work / args.shape
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({**LLAMA3_8B, "torch_dtype": args.dtype}))
    else:
        model_dir = args.model
    config = json.loads((model_dir / "config.json").read_text())
    stats_path = work / "loads.jsonl"
    settings = {"memory_service": "unused:0", "node_id": "bench", "model_dir": str(model_dir),
                "profile": {"profile_id": "kvp-synthetic"}, "synthetic_kv": True,
                "load_stats_path": "" if args.no_load_stats else str(stats_path),
                "node_cache_mb": args.node_cache_mb}
    llm = LLM(
        model=str(model_dir), load_format="dummy" if args.shape else "auto", skip_tokenizer_init=True,
        dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=True, seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_transfer_config=KVTransferConfig(
            kv_connector="InferScaleConnector", kv_connector_module_path="inference_node.connector",
            kv_role="kv_consumer", kv_load_failure_policy="fail", kv_connector_extra_config=settings),
    )
    rng = random.Random(0)
    vocab = config["vocab_size"]
    header = [rng.randrange(100, vocab) for _ in range(args.header_tokens)]
    counter = iter(range(10**9))

    def request(mode: str, k: int, user: int, everything: bool = False) -> tuple[TokensPrompt, dict[str, Any], int]:
        """One user's request: k facts of the user's pool, chosen and ordered per request as retrieval would
        (so text mode cannot reuse an earlier prompt's memory from the prefix cache, while kv mode finds each
        fact's KV in the node cache). `everything` takes the whole pool (to warm the node cache)."""
        pool = k + args.pool_extra
        chosen = list(range(pool)) if everything else rng.sample(range(pool), k)
        facts = [[random.Random(user * 1000 + i).randrange(100, vocab) for _ in range(args.tokens_per_fact)]
                 for i in chosen]
        k = len(chosen)
        query = [rng.randrange(100, vocab) for _ in range(args.query_tokens)]
        memory = [] if mode == "off" else [t for fact in facts for t in fact]
        prompt = TokensPrompt(prompt_token_ids=header + memory + query)
        extra: dict[str, Any] = {}
        if mode == "kv":
            chunks = [{"fact_id": "header", "version": 1, "token_ids": header}]
            chunks += [{"fact_id": f"u{user}-f{i}", "version": 1, "token_ids": fact}
                       for i, fact in zip(chosen, facts, strict=True)]
            extra = {"kv_transfer_params": {"inferscale": {"profile_id": "kvp-synthetic", "user_id": f"u{user}",
                                                           "chunks": chunks}}}
            prompt["cache_salt"] = f"request-{next(counter)}"  # per request: nothing reused from earlier prompts
        return prompt, extra, len(header) + len(memory)

    def ttft_ms(mode: str, k: int) -> tuple[float, int]:
        samples, cached = [], 0
        for repeat in range(args.repeats + 1):
            prompt, extra, _ = request(mode, k, user=repeat % args.batch)
            params = SamplingParams(max_tokens=1, temperature=0, extra_args=extra or None)
            started = time.perf_counter()
            output = llm.generate([prompt], params, use_tqdm=False)[0]
            if repeat:  # the first is a warm-up
                samples.append((time.perf_counter() - started) * 1000)
                cached = output.num_cached_tokens or 0
        return statistics.median(samples), cached

    results = {"model": args.shape or str(model_dir), "dtype": args.dtype, "synthetic_kv": True, "k": {}}
    for k in args.k:
        row: dict[str, Any] = {}
        warm = [request("kv", k, user, everything=True) for user in range(args.batch)]
        llm.generate([prompt for prompt, _, _ in warm],
                     [SamplingParams(max_tokens=1, extra_args=extra) for _, extra, _ in warm], use_tqdm=False)
        stats_path.unlink(missing_ok=True)
        for mode in ("text", "kv", "off"):
            median_ms, cached = ttft_ms(mode, k)
            row[f"ttft_ms_{mode}"] = median_ms
            row[f"cached_tokens_{mode}"] = cached
        memory_tokens = args.header_tokens + k * args.tokens_per_fact
        for mode in ("text", "kv"):
            prompts, params = [], []
            for user in range(args.batch):
                prompt, extra, _ = request(mode, k, user=user)
                prompts.append(prompt)
                params.append(SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True,
                                             extra_args=extra or None))
            llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, and the node cache sees the users
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            row[f"throughput_rps_{mode}"] = args.batch / (time.perf_counter() - started)
        row["memory_tokens"] = memory_tokens
        row["ttft_ratio_kv_text"] = row["ttft_ms_kv"] / row["ttft_ms_text"]
        row["throughput_ratio_kv_text"] = row["throughput_rps_kv"] / row["throughput_rps_text"]
        loads = [json.loads(line) for line in stats_path.read_text().splitlines()] if stats_path.exists() else []
        full = [load["ms"] for load in loads if load["chunks"] == k + 1 and not load["node_cache_misses"]]
        row["connector_ms_per_request_p50"] = statistics.median(full) if full else None
        warm_loads = [load for load in loads if load["chunks"] == k + 1 and not load["node_cache_misses"]]
        for phase in ("stage_ms", "compose_ms", "write_ms"):
            phase_ms = [load[phase] for load in warm_loads]
            row[f"connector_{phase}_p50"] = statistics.median(phase_ms) if phase_ms else None
        row["connector_loads_measured"] = len(full)
        results["k"][str(k)] = row
        stats_path.unlink(missing_ok=True)

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"\n== engine injection ({results['model']}, {args.dtype}, SYNTHETIC fact KV, dummy weights: "
          f"{bool(args.shape)}) ==")
    print(f"{'k':>4}{'mem tok':>9}{'TTFT text':>11}{'TTFT kv':>9}{'TTFT off':>10}{'kv/text':>9}{'thr text':>10}"
          f"{'thr kv':>9}{'thr x':>7}{'conn ms':>9}{'cached kv':>11}")
    for k, row in results["k"].items():
        print(f"{k:>4}{row['memory_tokens']:>9}{row['ttft_ms_text']:>11.1f}{row['ttft_ms_kv']:>9.1f}"
              f"{row['ttft_ms_off']:>10.1f}{row['ttft_ratio_kv_text']:>9.2f}{row['throughput_rps_text']:>10.1f}"
              f"{row['throughput_rps_kv']:>9.1f}{row['throughput_ratio_kv_text']:>7.2f}"
              f"{(row['connector_ms_per_request_p50'] or float('nan')):>9.2f}{row['cached_tokens_kv']:>11}")
        print(f"      connector phases p50 (ms): stage from node cache {row['connector_stage_ms_p50']}, "
              f"RoPE compose {row['connector_compose_ms_p50']}, cache writes {row['connector_write_ms_p50']}; "
              f"text-mode cached tokens {row['cached_tokens_text']}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    main()
