"""The kv crossover from a serving benchmark run: the smallest injected memory (tokens) from which kv's engine TTFT
was below text's at that k and at every larger k measured. The node serves shorter memories as text
(inference_node.crossover), so kv is never slower than text.

    python -m benchmarks.crossover OUT/serve-latency/results.json --model-dir DIR --dtype bfloat16 [--write]
    python -m benchmarks.crossover OUT/serve-latency/results.json --shape llama3-8b --model TOKENIZER_DIR ...

The key names the model's shape, the dtype and this machine's device (as the node computes it); --write records the
crossover in inference_node/kv_crossover.json (or --table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

from benchmarks.dummy_model import SHAPES, build_dummy_model
from inference_node.crossover import CROSSOVER_TABLE, shape_key


def crossover(results: dict[str, dict[str, dict]]) -> tuple[int, str]:
    """(tokens, how it was measured) from one load's results: contender -> k -> row, with kv always injecting."""
    kv, text = results["kv"], results["text"]
    rows = [(int(k), round(kv[k]["mean_cached_tokens"]), kv[k]["engine_ttft_ms"]["mean"],
             text[k]["engine_ttft_ms"]["mean"]) for k in sorted(kv, key=int) if k in text]
    if not rows:
        raise ValueError("no k measured for both kv and text")
    measured = "; ".join(f"k={k} ({tokens} tokens): kv {kv_ms:.1f} / text {text_ms:.1f} ms"
                         for k, tokens, kv_ms, text_ms in rows)
    for first in range(len(rows)):
        if all(kv_ms < text_ms for _, _, kv_ms, text_ms in rows[first:]):
            tokens = 0 if first == 0 else rows[first][1]
            return tokens, f"engine TTFT {measured}"
    return rows[-1][1] + 1, f"kv slower than text at every k measured: engine TTFT {measured}"


def record(table: Path, key: str, tokens: int, measured: str) -> None:
    data = json.loads(table.read_text())
    data["crossovers"][key] = {"tokens": tokens, "measured": f"{datetime.date.today().isoformat()}: {measured}"}
    table.write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="benchmarks.serve's results.json (a run with kv and text)")
    served = parser.add_mutually_exclusive_group(required=True)
    served.add_argument("--model-dir", type=Path, help="the model folder the node served")
    served.add_argument("--shape", choices=sorted(SHAPES), help="the dummy-weight shape the node served")
    parser.add_argument("--model", type=Path, help="with --shape: the tokenizer folder the run used")
    parser.add_argument("--dtype", required=True, help="the node's --dtype")
    parser.add_argument("--workload", default="synthetic")
    parser.add_argument("--load", default="c1")
    parser.add_argument("--write", action="store_true", help="record it in the crossover table")
    parser.add_argument("--table", type=Path, default=CROSSOVER_TABLE)
    args = parser.parse_args()

    from transformers import AutoConfig

    from inference_node.__main__ import device_name

    results = json.loads(args.results.read_text())["workloads"][args.workload]["results"][args.load]
    tokens, measured = crossover(results)
    with tempfile.TemporaryDirectory() as folder:
        model_dir = args.model_dir or build_dummy_model(Path(folder), args.shape, args.model, args.dtype)
        key = shape_key(AutoConfig.from_pretrained(model_dir), args.dtype, device_name())
    print(f"kv crossover for {key}: {tokens} tokens ({measured})")
    if args.write:
        record(args.table, key, tokens, measured)
        print(f"recorded in {args.table}")


if __name__ == "__main__":
    main()
