"""`python -m inference_node --memory-service HOST:PORT --model DIR [vLLM flags...]`

Starts vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server) with InferScale's KV connector and
memory middleware configured; every flag it does not know is passed to vLLM unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys
from pathlib import Path

from inference_node.crossover import measured_crossover, shape_key
from inference_node.plan import PLAN_SECRET_ENV, PlanSecretMissing, plan_secret_from_env
from inference_node.settings import DEFAULT_RECOMPUTE_TAIL_FACTS, SETTINGS_ENV, NodeSettings
from inferscale_kv.device_telemetry import read_device
from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW, KV_DTYPES

ENV_PREFIX = "INFERSCALE_NODE_"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
MIN_VLLM_GPU_SHARE = 0.05


def _env(name: str, default):
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m inference_node", add_help=True, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="vLLM's OpenAI server with InferScale memory (KV connector + middleware). Unknown flags go "
        f"to vLLM. Flags also read {ENV_PREFIX}<FLAG>.")
    parser.add_argument("--memory-service", default=_env("memory_service", "127.0.0.1:50051"))
    parser.add_argument("--model", default=_env("model", None), help="local model folder (also passed to vLLM)")
    parser.add_argument("--node-id", default=_env("node_id", socket.gethostname()))
    parser.add_argument("--kv-dtype", default=_env("kv_dtype", "float32"), choices=KV_DTYPES,
                        help="storage dtype of the fact KV this node serves (the workers' --kv-dtype)")
    parser.add_argument("--context-window", type=int, default=int(_env("context_window", DEFAULT_CONTEXT_WINDOW)),
                        help="the workers' --context-window")
    parser.add_argument("--model-name", default=_env("model_name", None), help="the workers' --model-name")
    parser.add_argument("--node-cache-mb", type=int, default=int(_env("node_cache_mb", 4096)),
                        help="device memory for cached fact KV")
    parser.add_argument("--memory-top-k", type=int, default=int(_env("memory_top_k", 20)),
                        help="facts per request when the request does not say")
    parser.add_argument("--synchronous-loads", choices=("auto", "on", "off"),
                        default=_env("synchronous_loads", "auto"),
                        help="load node-cache-resident KV synchronously; auto: on for CPU, off on CUDA (vLLM 0.26 "
                        "recomputes a refused synchronous load wrongly there)")
    parser.add_argument("--kv-crossover-tokens", type=int, default=int(_env("kv_crossover_tokens", -1)),
                        help="serve a memory shorter than this (injectable tokens) as text, where injecting it is "
                        "slower; -1: the crossover measured for this model, dtype and device (kv_crossover.json), 0 "
                        "if none was")
    parser.add_argument("--recompute-tail-facts", type=int,
                        default=int(_env("recompute_tail_facts", DEFAULT_RECOMPUTE_TAIL_FACTS)),
                        help="kv mode: prefill the m facts nearest the question as text after the injected ones")
    parser.add_argument("--retrieve-timeout-s", type=float, default=float(_env("retrieve_timeout_s", 2.0)),
                        help="deadline of the RetrieveAndStage call; past it the request is answered without memory")
    parser.add_argument("--fetch-timeout-s", type=float, default=float(_env("fetch_timeout_s", 10.0)),
                        help="deadline of a fact-KV fetch from the memory service; past it the tokens are recomputed")
    parser.add_argument("--load-stats-path", default=_env("load_stats_path", ""),
                        help="benchmarks only: append per-load timings (JSON lines; synchronizes the device per load)")
    parser.add_argument("--embed-queries-locally", action="store_true",
                        default=str(_env("embed_queries_locally", "")).lower() in ("1", "true", "yes"),
                        help="embed each query on this node's device and send the vector with RetrieveAndStage "
                        "(the memory service then spends no CPU on it)")
    parser.add_argument("--embedding-model", default=_env("embedding_model", DEFAULT_EMBEDDING_MODEL),
                        help="the memory service's --embedding-model (for --embed-queries-locally)")
    parser.add_argument("--user-header", default=_env("user_header", ""),
                        help="request header naming the caller's user (set by your authenticating gateway); when set, "
                        "memory.user_id must equal it")
    parser.add_argument("--dry-run", action="store_true", help="print the vLLM command and exit")
    return parser


def kv_transfer_config(settings: NodeSettings) -> dict:
    """vLLM's --kv-transfer-config for InferScale's connector (the plan secret travels in the environment)."""
    return {
        "kv_connector": "InferScaleConnector",
        "kv_connector_module_path": "inference_node.connector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": json.loads(settings.to_json()),
    }


def vllm_command(argv: list[str] | None = None) -> tuple[list[str], NodeSettings]:
    args, vllm_args = build_parser().parse_known_args(argv)
    if not args.model or not Path(args.model).is_dir():
        raise SystemExit(f"inference_node: --model: {args.model!r} is not a local model folder")
    if args.recompute_tail_facts < 0:
        raise SystemExit("inference_node: --recompute-tail-facts must be 0 or more")
    from transformers import AutoConfig, AutoTokenizer

    model_dir = Path(args.model)
    profile = build_model_profile(model_dir, AutoTokenizer.from_pretrained(model_dir), args.kv_dtype,
                                  args.context_window, args.model_name)
    device_bytes = cuda_device_bytes()
    synchronous_loads = device_bytes is None if args.synchronous_loads == "auto" else args.synchronous_loads == "on"
    crossover = args.kv_crossover_tokens
    if crossover < 0:
        key = shape_key(AutoConfig.from_pretrained(model_dir), _flag(vllm_args, "--dtype") or "auto", device_name())
        crossover = measured_crossover(key) or 0
    settings = NodeSettings(memory_service=args.memory_service, node_id=args.node_id, model_dir=str(model_dir),
                            profile=profile.as_dict(), node_cache_mb=args.node_cache_mb,
                            default_top_k=args.memory_top_k, recompute_tail_facts=args.recompute_tail_facts,
                            kv_crossover_tokens=crossover,
                            synchronous_loads=synchronous_loads, retrieve_timeout_s=args.retrieve_timeout_s,
                            fetch_timeout_s=args.fetch_timeout_s, load_stats_path=args.load_stats_path,
                            user_header=args.user_header, embed_queries_locally=args.embed_queries_locally,
                            embedding_model=args.embedding_model)
    if args.recompute_tail_facts > settings.max_top_k:
        raise SystemExit(f"inference_node: --recompute-tail-facts must be at most {settings.max_top_k} (the most facts "
                         "a request may retrieve)")
    transfer = kv_transfer_config(settings)
    vllm_args = within_gpu_memory_budget(vllm_args, args.node_cache_mb << 20, device_bytes)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               *vllm_args, "--kv-transfer-config", json.dumps(transfer),
               "--middleware", "inference_node.middleware.MemoryMiddleware", "--enable-prompt-tokens-details"]
    return command, settings


def _flag(args: list[str], name: str) -> str | None:
    """The value of `name` among vLLM's flags (`--name value` or `--name=value`), if given."""
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def device_name() -> str:
    """"cpu", or the first CUDA device's name."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def cuda_device_bytes() -> int | None:
    """Total memory of the node's GPU, as NVML reads it; None without one (CPU nodes: the node cache is host
    memory)."""
    reading = read_device()
    return reading.memory_total_bytes if reading else None


def within_gpu_memory_budget(vllm_args: list[str], node_cache_bytes: int, device_bytes: int | None) -> list[str]:
    """vLLM's flags with --gpu-memory-utilization lowered by the node cache's share of the device, so that vLLM
    and the node cache together stay within the fraction the operator gave (vLLM's default 0.9 when not given)."""
    if device_bytes is None:
        return vllm_args
    args, utilization = list(vllm_args), DEFAULT_GPU_MEMORY_UTILIZATION
    for index, arg in enumerate(args):
        if arg == "--gpu-memory-utilization" and index + 1 < len(args):
            utilization = float(args[index + 1])
            del args[index : index + 2]
            break
        if arg.startswith("--gpu-memory-utilization="):
            utilization = float(arg.split("=", 1)[1])
            del args[index]
            break
    remaining = utilization - node_cache_bytes / device_bytes
    if remaining < MIN_VLLM_GPU_SHARE:
        raise SystemExit(f"inference_node: --node-cache-mb {node_cache_bytes >> 20} takes "
                         f"{node_cache_bytes / device_bytes:.1%} of the device's {device_bytes >> 20} MiB, leaving vLLM "
                         f"{remaining:.1%} of --gpu-memory-utilization {utilization}: lower --node-cache-mb")
    return [*args, "--gpu-memory-utilization", f"{remaining:.4f}"]


def main(argv: list[str] | None = None) -> None:
    command, settings = vllm_command(argv)
    if "--dry-run" in (argv if argv is not None else sys.argv[1:]):
        print(" ".join(command))
        return
    # The plan secret reaches vLLM's processes by inheritance only (vLLM logs its config, not its environment).
    secret = os.environ.get(PLAN_SECRET_ENV) or secrets.token_hex(32)
    os.environ[PLAN_SECRET_ENV] = secret
    try:
        plan_secret_from_env()
    except PlanSecretMissing as exc:
        raise SystemExit(f"inference_node: {exc}") from None
    os.execvpe(command[0], command, {**os.environ, SETTINGS_ENV: settings.to_json(), PLAN_SECRET_ENV: secret})


if __name__ == "__main__":
    main()
