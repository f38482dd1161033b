"""vLLM's failure path for refused synchronous loads on the stack this runs on (made for the lent GPU):

    python -m benchmarks.gpu_failure_path OUT_DIR [RUN ...]      # RUN: see RUNS (default: all)

Builds the tiny fp32 Llama, then runs `engine_scenario local` once per run: a model-runner setting (vLLM's
default, Model Runner V2, V1) and whether the node loads resident KV synchronously. Each run injects a fact's KV
(warm), then makes its load fail (the worker lost the chunks: lost; a shorter stale entry: stale; cold chunks and
no memory service: fetch_fails); with kv_load_failure_policy="recompute" every output must equal the same prompt
prefilled as text (why it is checked: benchmarks/RESULTS.md, "Refused loads on the GPU"). Writes
OUT_DIR/failure_path.json and prints one line per (run, step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# run name -> (VLLM_USE_V2_MODEL_RUNNER or None for vLLM's default, the node's loads: sync | async)
RUNS = {"default-sync": (None, "sync"), "v2-sync": ("1", "sync"), "v1-sync": ("0", "sync"),
        "default-async": (None, "async"), "v1-async": ("0", "async")}
STEPS = ("warm", "lost", "stale", "fetch_fails")


def run_scenario(model_dir: Path, runner: str | None, loads: str, log_path: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "VLLM_USE_V2_MODEL_RUNNER"}
    if runner is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = runner
    done = subprocess.run([sys.executable, "-m", "harness.engine_scenario", "local", str(model_dir),
                           "float32", loads], capture_output=True, text=True, env=env, timeout=900)
    log_path.write_text(done.stdout + "\n" + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: see {log_path}", "tail": done.stderr[-2000:]}
    return json.loads(lines[-1].removeprefix("RESULT "))


def compare(result: dict) -> dict[str, dict]:
    """Per step: same greedy tokens as text, the largest |logprob difference|, refused loads, fetch attempts."""
    text = result["text"]
    rows = {}
    for step in STEPS:
        got = result.get(step)
        if got is None:
            continue
        # An output that differs may stop at another length: logprobs are compared over the common prefix.
        logprob_pairs = zip(got["logprobs"], text["logprobs"], strict=False)
        rows[step] = {"equal_tokens": got["tokens"] == text["tokens"],
                      "max_abs_logprob_diff": max(abs(a - b) for a, b in logprob_pairs),
                      "external_tokens": got["external_tokens"], "loads_refused": got["loads_refused"],
                      "fetch_attempts": got["fetch_attempts"]}
    return rows


def main(out_dir: Path, runs: list[str]) -> None:
    from harness.tiny_llama import build_tiny_llama

    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_llama(out_dir / "tiny-llama")
    report = {}
    for name in runs or list(RUNS):
        result = run_scenario(model_dir, *RUNS[name], out_dir / f"scenario-{name}.log")
        report[name] = {"raw": result, "steps": compare(result) if "error" not in result else result}
        (out_dir / "failure_path.json").write_text(json.dumps(report, indent=2))
        if "error" in result:
            print(f"{name}: {result['error']}\n{result['tail']}", flush=True)
            continue
        for step, row in report[name]["steps"].items():
            print(f"run={name:<14} device={result['device']} step={step:<12} equal_tokens={row['equal_tokens']} "
                  f"max|dlogprob|={row['max_abs_logprob_diff']:.2e} external={row['external_tokens']} "
                  f"refused={row['loads_refused']} fetches={row['fetch_attempts']}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
