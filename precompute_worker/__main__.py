"""`python -m precompute_worker --memory-service HOST:PORT --model DIR [--context-window W] [--kv-dtype D]`"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

import grpc
import structlog

from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import WORKER, memory_service_channel
from inferscale_kv.layout import memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW, KV_DTYPES
from inferscale_kv.runtime import configure_logging
from precompute_worker.encoder import DTYPES, FactEncoder
from precompute_worker.worker import PrecomputeWorker

ENV_PREFIX = "INFERSCALE_WORKER_"


def _env(name: str, default):
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m precompute_worker", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="InferScale precompute worker: leases facts from the memory service, computes their KV "
        f"(pre-RoPE keys, Context-Window Encoding) and uploads it. Flags also read {ENV_PREFIX}<FLAG>.")
    parser.add_argument("--memory-service", default=_env("memory_service", "127.0.0.1:50051"))
    parser.add_argument("--model", default=_env("model", None), help="local HF model folder (the weights vLLM serves)")
    parser.add_argument("--model-name", default=_env("model_name", None), help="name in the profile (default: folder name)")
    parser.add_argument("--dtype", default=_env("dtype", "float32"), choices=sorted(DTYPES), help="compute dtype")
    parser.add_argument("--kv-dtype", default=_env("kv_dtype", None), choices=KV_DTYPES,
                        help="storage dtype (default: the compute dtype)")
    parser.add_argument("--context-window", type=int, default=int(_env("context_window", DEFAULT_CONTEXT_WINDOW)),
                        help="Context-Window Encoding: preceding turns (0 none, -1 all)")
    parser.add_argument("--device", default=_env("device", "cpu"))
    parser.add_argument("--worker-id", default=_env("worker_id", f"{socket.gethostname()}-{os.getpid()}"))
    parser.add_argument("--max-facts", type=int, default=int(_env("max_facts", 64)), help="facts per lease")
    parser.add_argument("--lease-seconds", type=int, default=int(_env("lease_seconds", 120)))
    parser.add_argument("--max-tokens-per-forward", type=int, default=int(_env("max_tokens_per_forward", 2048)))
    parser.add_argument("--encoding", choices=("shared", "naive"), default=_env("encoding", "shared"),
                        help="shared: one forward per conversation window; naive: one forward per fact")
    parser.add_argument("--poll-interval-s", type=float, default=float(_env("poll_interval_s", 1.0)))
    parser.add_argument("--exit-when-idle", action="store_true", help="stop once no work is left")
    parser.add_argument("--threads", type=int, default=int(_env("threads", 0)), help="torch threads (0: default)")
    parser.add_argument("--log-level", default=_env("log_level", "info"))
    return parser


def main(argv: list[str] | None = None, encoder_factory=None) -> int:
    """Runs the worker; `encoder_factory(args, model_dir)` replaces the model's own encoder (speed runs only)."""
    args = build_parser().parse_args(argv)
    if not args.model or not Path(args.model).is_dir():
        print(f"precompute_worker: --model: {args.model!r} is not a model folder", file=sys.stderr)
        return 2
    if args.context_window < -1:
        print("precompute_worker: --context-window: must be >= 0, or -1 for all preceding turns", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    log = structlog.get_logger("precompute_worker")
    import torch
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    profile = build_model_profile(model_dir, tokenizer, args.kv_dtype or args.dtype, args.context_window,
                                  args.model_name)
    log.info("config", **vars(args), profile_id=profile.profile_id)
    if encoder_factory is not None:
        encoder = encoder_factory(args, model_dir)
    else:
        encoder = FactEncoder.from_pretrained(model_dir, args.dtype, args.device, args.max_tokens_per_forward)
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with memory_service_channel(args.memory_service, WORKER,
                                options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        worker = PrecomputeWorker(
            memory_pb2_grpc.MemoryServiceStub(channel), encoder, tokenizer, memory_header_ids(tokenizer), profile,
            args.worker_id, max_facts=args.max_facts, lease_seconds=args.lease_seconds,
            shared_encoding=args.encoding == "shared")
        grpc.channel_ready_future(channel).result(timeout=300)
        worker.announce()
        stats = worker.run(exit_when_idle=args.exit_when_idle, poll_interval_s=args.poll_interval_s,
                           stop=lambda: stopping)
    log.info("worker_stopped", facts_done=stats.facts_done, facts_failed=stats.facts_failed,
             facts_per_s=round(stats.facts_per_second, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
