"""`python -m inference_node --memory-service HOST:PORT --model DIR [vLLM flags...]`

Starts vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server) with InferScale's KV connector and
memory middleware configured; every flag it does not know is passed to vLLM unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inference_node.crossover import MEASURED, crossover_flag, measured_crossover, shape_key
from inference_node.durable_blobs import DirectoryBlobs, durable_blobs
from inference_node.plan import PLAN_SECRET_ENV, PlanSecretMissing, plan_secret_from_env
from inference_node.settings import SETTINGS_ENV, NodeSettings
from inferscale_kv.device_telemetry import read_device
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.options import OptionParser, option
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW, KV_DTYPES

ENV_PREFIX = "INFERSCALE_NODE_"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
MIN_VLLM_GPU_SHARE = 0.05
# --node-cache-mb 0: this share of what --gpu-memory-utilization leaves after the weights (the rest: vLLM's paged
# cache), within these bounds; on a CPU node, CPU_NODE_CACHE_MB.
NODE_CACHE_SHARE = 0.25
MIN_NODE_CACHE_MB = 512
CPU_NODE_CACHE_MB = 1024
# --host-tier-mb not given: this share of the host's memory (or the container's limit), at most MAX_HOST_TIER_MB,
# shared by the tensor-parallel ranks.
HOST_TIER_SHARE = 0.25
MAX_HOST_TIER_MB = 64 << 10


@dataclass(frozen=True)
class NodeOptions:
    """The node's flags that are not NodeSettings' own: each field is a flag, `--kv-dtype`, and a variable,
    `INFERSCALE_NODE_KV_DTYPE`."""

    memory_service: str = option("127.0.0.1:50051", help="the memory service's address (HOST:PORT, or dns:///...)")
    model: str | None = option(None, help="local model folder (also passed to vLLM)")
    node_id: str = option(default_factory=socket.gethostname, help="this node's name towards the memory service")
    kv_dtype: str = option("float32", choices=KV_DTYPES,
                           help="storage dtype of the fact KV this node serves (the workers' --kv-dtype)")
    context_window: int = option(DEFAULT_CONTEXT_WINDOW, help="the workers' --context-window")
    model_name: str | None = option(None, help="the workers' --model-name")
    synchronous_loads: str = option(
        "auto", choices=("auto", "on", "off"),
        help="deprecated, ignored: every load is synchronous (its chunks are fetched into the node cache first)")
    kv_crossover_tokens: str = option(
        MEASURED, parse=crossover_flag,
        help="serve a memory shorter than this many injectable tokens as text, where injecting it is slower: a number, "
        f"or {MEASURED}: the crossover measured for this model, dtype and device (kv_crossover.json), 0 if none was "
        f"(-1 still reads as {MEASURED})")
    dry_run: bool = option(False, help="print the vLLM command and exit")


def build_parser() -> OptionParser:
    parser = OptionParser(
        ENV_PREFIX, prog="python -m inference_node", usage="%(prog)s [flags] [vLLM flags]",
        description="vLLM's OpenAI server with InferScale memory (KV connector + middleware). Unknown flags go "
        f"to vLLM. Flags also read {ENV_PREFIX}<FLAG>.")
    parser.add_options(NodeOptions)
    parser.add_options(NodeSettings, title="settings handed to vLLM's processes")
    return parser


def kv_transfer_config(settings: NodeSettings) -> dict:
    """vLLM's --kv-transfer-config for InferScale's connector (the plan secret travels in the environment). Every
    load is proven resident before it is declared, so a load that fails is a defect: "fail" ends that request with
    an error instead of vLLM's recompute of a refused synchronous load (wrong on vLLM 0.26, benchmarks/RESULTS.md,
    "Refused loads on the GPU")."""
    return {
        "kv_connector": "InferScaleConnector",
        "kv_connector_module_path": "inference_node.connector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": json.loads(settings.to_json()),
    }


@dataclass(frozen=True)
class NodeLaunch:
    """What `python -m inference_node` runs: vLLM's command line, and the settings it hands vLLM's processes."""

    command: list[str]
    settings: NodeSettings
    dry_run: bool


# vLLM flags that make (or may make: a config file, overrides) its chat rendering other than the model tokenizer's
# template applied to the messages; also when abbreviated, as vLLM's parser allows.
CHAT_RENDERING_FLAGS = ("--chat-template", "--chat-template-content-format", "--default-chat-template-kwargs",
                        "--tokenizer", "--tokenizer-mode", "--config", "--hf-overrides")
# Architectures vLLM serves with the Hugging Face renderer (the tokenizer's chat template, no tokenizer mode of its
# own). Any other renders chat as text: vLLM may render it its own way (DeepSeek, Kimi, Harmony, ...).
HF_CHAT_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                   "Gemma2ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM"})


def vllm_renders_chat_with_the_tokenizer(model_dir: Path, config: object, vllm_args: Sequence[str]) -> bool:
    """Whether vLLM renders this model's chat prompts as the middleware does: its tokenizer's chat template applied
    to the messages (inference_node.placement). Not where a vLLM flag names another template, content format,
    template arguments or tokenizer (abbreviated too), for an architecture outside HF_CHAT_ARCHITECTURES, a folder
    with a processor (vLLM prefers its template) or Mistral's own tokenizer files (vLLM then uses Mistral's)."""
    for arg in vllm_args:
        name = arg.split("=", 1)[0].replace("_", "-")
        if len(name) > 2 and name.startswith("--") and any(flag.startswith(name) for flag in CHAT_RENDERING_FLAGS):
            return False
    own_renderer = ("processor_config.json", "preprocessor_config.json", "chat_template.json", "tekken.json",
                    "tokenizer.model.v*")
    architectures = set(getattr(config, "architectures", None) or ())
    return (bool(architectures) and architectures <= HF_CHAT_ARCHITECTURES
            and not any(any(model_dir.glob(pattern)) for pattern in own_renderer))


def longest_prompt_tokens(config: object, vllm_args: Sequence[str]) -> int:
    """The most tokens a prompt can have on this node, at least: --max-model-len where it is a number, and the
    model's positions (times its RoPE scaling factor)."""
    scaling = getattr(config, "rope_scaling", None) or {}
    positions = int((getattr(config, "max_position_embeddings", 0) or 0) * float(scaling.get("factor") or 1))
    flag = _flag(list(vllm_args), "--max-model-len") or ""
    return max(int(flag) if flag.isdigit() else 0, positions)


def plan_launch(argv: Sequence[str] | None = None) -> NodeLaunch:
    """The node's flags (and environment) read, checked and turned into vLLM's command line; SystemExit naming the
    flag where one is wrong."""
    parser = build_parser()
    args, vllm_args = parser.parse_known_args(argv)
    options = parser.build(NodeOptions, args)
    if not options.model or not Path(options.model).is_dir():
        raise SystemExit(f"inference_node: --model: {options.model!r} is not a local model folder")
    from transformers import AutoConfig, AutoTokenizer

    model_dir = Path(options.model)
    profile = build_model_profile(model_dir, AutoTokenizer.from_pretrained(model_dir), options.kv_dtype,
                                  options.context_window, options.model_name)
    if options.synchronous_loads != "auto":
        print("inference_node: --synchronous-loads is deprecated and ignored: every load is synchronous",
              file=sys.stderr)
    device_bytes = cuda_device_bytes()
    config = AutoConfig.from_pretrained(model_dir)
    if options.kv_crossover_tokens == MEASURED:
        key = shape_key(config, _flag(vllm_args, "--dtype") or "auto", device_name())
        crossover = measured_crossover(key) or 0
    else:
        crossover = int(options.kv_crossover_tokens)
    settings = parser.build(NodeSettings, args, memory_service=options.memory_service, node_id=options.node_id,
                            model_dir=str(model_dir), profile=profile.as_dict(), kv_crossover_tokens=crossover)
    if settings.node_cache_mb < 0 or (settings.host_tier_mb or 0) < 0 or settings.warm_facts < 0:
        raise SystemExit("inference_node: --node-cache-mb, --host-tier-mb and --warm-facts must be 0 or more")
    ranks = int(_flag(vllm_args, "--tensor-parallel-size") or _flag(vllm_args, "-tp") or 1)
    settings = dataclasses.replace(
        settings,
        node_cache_mb=settings.node_cache_mb or default_node_cache_mb(
            device_bytes, _gpu_memory_utilization(vllm_args), weights_bytes(model_dir) // ranks),
        host_tier_mb=(settings.host_tier_mb if settings.host_tier_mb is not None
                      else default_host_tier_mb(host_memory_bytes(), device_bytes, ranks)))
    try:
        durable = durable_blobs(settings.kv_durable_tier)
    except ValueError as error:
        raise SystemExit(f"inference_node: {error}") from None
    if settings.user_token_header and "--enable-log-requests" in vllm_args:
        raise SystemExit("inference_node: --enable-log-requests logs each request's kv_transfer_params, the user "
                         "token --user-token-header forwards among them: use one or the other")
    if durable is not None and settings.user_token_header:
        raise SystemExit("inference_node: --kv-durable-tier reads every user's KV from the store itself, around the "
                         "user tokens --user-token-header forwards: use one or the other")
    if isinstance(durable, DirectoryBlobs) and not durable.root.is_dir():
        raise SystemExit(f"inference_node: --kv-durable-tier: {durable.root} is not a directory")
    if settings.recompute_tail_facts < 0:
        raise SystemExit("inference_node: --recompute-tail-facts must be 0 or more")
    if settings.recompute_tail_facts > settings.max_top_k:
        raise SystemExit(f"inference_node: --recompute-tail-facts must be at most {settings.max_top_k} (the most facts "
                         "a request may retrieve)")
    settings = dataclasses.replace(settings, chat_token_ids=vllm_renders_chat_with_the_tokenizer(model_dir, config,
                                                                                                 vllm_args),
                                   max_model_len=longest_prompt_tokens(config, vllm_args))
    transfer = kv_transfer_config(settings)
    vllm_args = within_gpu_memory_budget(vllm_args, settings.node_cache_mb << 20, device_bytes)
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               *vllm_args, "--kv-transfer-config", json.dumps(transfer),
               "--middleware", "inference_node.middleware.MemoryMiddleware", "--enable-prompt-tokens-details"]
    return NodeLaunch(command, settings, options.dry_run)


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


def default_node_cache_mb(device_bytes: int | None, utilization: float, weights: int) -> int:
    """--node-cache-mb 0: NODE_CACHE_SHARE of the device memory `utilization` gives vLLM beyond the model's weights,
    at least MIN_NODE_CACHE_MB; CPU_NODE_CACHE_MB on a CPU node."""
    if device_bytes is None:
        return CPU_NODE_CACHE_MB
    return max(MIN_NODE_CACHE_MB, int(NODE_CACHE_SHARE * (utilization * device_bytes - weights)) >> 20)


def default_host_tier_mb(host_bytes: int, device_bytes: int | None, ranks: int) -> int:
    """--host-tier-mb not given: each of `ranks` ranks' share of HOST_TIER_SHARE of the host's (or container's)
    memory, at most MAX_HOST_TIER_MB in all; none on a CPU node (its device tier is host memory)."""
    if device_bytes is None:
        return 0
    return min(MAX_HOST_TIER_MB, int(HOST_TIER_SHARE * host_bytes) >> 20) // max(1, ranks)


def host_memory_bytes() -> int:
    """The memory this process may use: the host's, or the container's cgroup limit where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def weights_bytes(model_dir: Path) -> int:
    """The model's weights as stored: its safetensors files, or else its PyTorch ones (training state left out);
    what vLLM's share holds before its cache, over every rank."""
    files = list(model_dir.glob("*.safetensors")) or [
        path for pattern in ("*.bin", "*.pt") for path in model_dir.glob(pattern)
        if not path.name.startswith(("training_args", "optimizer", "scheduler", "rng_state"))]
    return sum(path.stat().st_size for path in files)


def _gpu_memory_utilization(vllm_args: list[str]) -> float:
    value = _flag(vllm_args, "--gpu-memory-utilization")
    return float(value) if value is not None else DEFAULT_GPU_MEMORY_UTILIZATION


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
                         f"{node_cache_bytes / device_bytes:.1%} of the device's {device_bytes >> 20} MiB, leaving "
                         f"vLLM {remaining:.1%} of --gpu-memory-utilization {utilization}: lower --node-cache-mb")
    return [*args, "--gpu-memory-utilization", f"{remaining:.4f}"]


def main(argv: Sequence[str] | None = None) -> None:
    launch = plan_launch(argv)
    if launch.dry_run:
        print(" ".join(launch.command))
        return
    # The plan secret reaches vLLM's processes by inheritance only (vLLM logs its config, not its environment).
    secret = os.environ.get(PLAN_SECRET_ENV) or secrets.token_hex(32)
    os.environ[PLAN_SECRET_ENV] = secret
    try:
        plan_secret_from_env()
    except PlanSecretMissing as exc:
        raise SystemExit(f"inference_node: {exc}") from None
    os.execvpe(launch.command[0], launch.command,
               {**os.environ, SETTINGS_ENV: launch.settings.to_json(), PLAN_SECRET_ENV: secret})


if __name__ == "__main__":
    main()
