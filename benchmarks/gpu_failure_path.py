"""Every way a synchronous load could fail, injected into vLLM on the stack this runs on (made for the lent GPU):

    python -m benchmarks.gpu_failure_path --output OUT_DIR [--work DIR] [--runs default v2 v1]

Builds the tiny fp32 Llama (under --work), then runs `harness.engine_scenario local` once per model runner (vLLM's
default, Model Runner V2, V1; VLLM_USE_V2_MODEL_RUNNER) under the node's settings (every load synchronous, proven
resident first; kv_load_failure_policy="fail"). Each step's output must equal the same prompt prefilled as text; a
defect step (lost, stale, device_error) must instead fail its request with an error, and the next request must equal
text again (why this is checked on the GPU: benchmarks/RESULTS.md, "Refused loads on the GPU"). Writes
OUT_DIR/failure_path.json, prints one line per (run, step) and ends with a verdict; exits 1 if any step is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# run name -> VLLM_USE_V2_MODEL_RUNNER (None: vLLM's default)
RUNS: dict[str, str | None] = {"default": None, "v2": "1", "v1": "0"}
# step -> the text reference its output must equal
EQUAL_TO_TEXT = {"cold": "text", "warm": "text", "off": "text", "shared": "text", "shared_1": "text",
                 "intruder": "text", "partial_hit": "text_other", "full_prompt": "text_full_prompt",
                 "mismatch": "text_mismatch", "fetch_fails": "text", "fetch_slow": "text", "aborted": "text",
                 "after_lost": "text", "after_stale": "text", "after_device_error": "text"}
DEFECTS = ("lost", "stale", "device_error")
LOGPROB_TOLERANCE = 1e-2  # fp32 on the GPU: FlashAttention's sums differ from prefill's in the last bits


def run_scenario(model_dir: Path, runner: str | None, log_path: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "VLLM_USE_V2_MODEL_RUNNER"}
    if runner is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = runner
    done = subprocess.run([sys.executable, "-m", "harness.engine_scenario", "local", str(model_dir), "float32"],
                          capture_output=True, text=True, env=env, timeout=900)
    log_path.write_text(done.stdout + "\n" + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: see {log_path}", "tail": done.stderr[-2000:]}
    return json.loads(lines[-1].removeprefix("RESULT "))


def judge(result: dict) -> dict[str, dict]:
    """Per step: whether it did what it must (equal to its text reference, or for a defect an error), and why."""
    rows = {}
    for step, reference_name in EQUAL_TO_TEXT.items():
        got, reference = result.get(step), result.get(reference_name)
        if got is None or reference is None:
            rows[step] = {"ok": False, "why": "not run"}
            continue
        # An output that differs may stop at another length: logprobs are compared over the common prefix.
        difference = max((abs(a - b) for a, b in zip(got["logprobs"], reference["logprobs"], strict=False)),
                         default=0.0)
        equal = got["tokens"] == reference["tokens"] and got["finish_reason"] == reference["finish_reason"]
        rows[step] = {"ok": equal and difference <= LOGPROB_TOLERANCE and not got.get("async"),
                      "why": f"equal_tokens={equal} max|dlogprob|={difference:.1e} claims={got.get('claims')} "
                             f"waits={got.get('waits')} admitted_after={got.get('admitted_after')}"}
    for step in DEFECTS:
        got = result.get(step)
        failed = got is not None and got["finish_reason"] == "error" and not got["tokens"]
        rows[step] = {"ok": failed, "why": f"finish_reason={got and got['finish_reason']} (must be error)"}
    threads = result.get("fetch_threads") or []
    rows["fetch_threads"] = {"ok": bool(threads) and all(name.startswith("inferscale-fetch") for name in threads),
                             "why": f"fetches ran on {threads}"}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="folder for failure_path.json and the logs")
    parser.add_argument("--work", type=Path, default=None, help="folder for the tiny model (default: under --output)")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS),
                        help="model runners to run the scenario under")
    args = parser.parse_args()
    from harness.tiny_llama import build_tiny_llama

    args.output.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_llama((args.work or args.output) / "tiny-llama")
    report, wrong = {}, []
    for name in args.runs:
        result = run_scenario(model_dir, RUNS[name], args.output / f"scenario-{name}.log")
        report[name] = {"raw": result, "steps": judge(result) if "error" not in result else {}}
        (args.output / "failure_path.json").write_text(json.dumps(report, indent=2))
        if "error" in result:
            print(f"run={name}: {result['error']}\n{result['tail']}", flush=True)
            wrong.append(name)
            continue
        for step, row in report[name]["steps"].items():
            print(f"run={name:<8} device={result['device']} step={step:<19} {'ok' if row['ok'] else 'WRONG'} "
                  f"{row['why']}", flush=True)
            if not row["ok"]:
                wrong.append(f"{name}/{step}")
    print(f"verdict: {'every step right' if not wrong else 'WRONG: ' + ', '.join(wrong)}", flush=True)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
