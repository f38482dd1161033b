"""`python -m precompute_worker --memory-service HOST:PORT --model DIR [--context-window W] [--kv-dtype D]`"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog

from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import WORKER, memory_service_channel
from inferscale_kv.layout import memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.options import OptionParser, option
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW, KV_DTYPES
from inferscale_kv.runtime import configure_logging
from precompute_worker.encoder import DTYPES, FactEncoder
from precompute_worker.worker import PrecomputeWorker

ENV_PREFIX = "INFERSCALE_WORKER_"


@dataclass(frozen=True)
class WorkerOptions:
    """The worker's options: each field is a flag, `--max-facts`, and a variable, `INFERSCALE_WORKER_MAX_FACTS`."""

    memory_service: str = option("127.0.0.1:50051", help="the memory service's address (HOST:PORT, or dns:///...)")
    model: str | None = option(None, help="local HF model folder (the weights vLLM serves)")
    model_name: str | None = option(None, help="name in the profile (unset: the folder's name)")
    dtype: str = option("float32", choices=sorted(DTYPES), help="compute dtype")
    kv_dtype: str | None = option(None, choices=KV_DTYPES, help="storage dtype (unset: the compute dtype)")
    context_window: int = option(DEFAULT_CONTEXT_WINDOW,
                                 help="Context-Window Encoding: preceding turns (0 none, -1 all)")
    device: str = option("cpu", help="torch device the model runs on")
    worker_id: str = option(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                            help="this worker's name in its leases")
    max_facts: int = option(64, help="facts per lease")
    lease_seconds: int = option(120, help="lease length (seconds; at most the memory service's --kv-lease-max-seconds)")
    max_tokens_per_forward: int = option(2048, help="most tokens in one forward pass")
    encoding: str = option("shared", choices=("shared", "naive"),
                           help="shared: one forward per conversation window; naive: one forward per fact")
    poll_interval_s: float = option(1.0, help="wait between lease attempts while there is no work")
    exit_when_idle: bool = option(False, help="stop once no work is left")
    threads: int = option(0, help="torch threads (0: torch's default)")
    log_level: str = option("info", help="logging level")


# Builds an encoder (FactEncoder's interface, which speed runs implement with random KV) from the options and the
# model folder.
EncoderFactory = Callable[[WorkerOptions, Path], Any]


def build_parser() -> OptionParser:
    parser = OptionParser(
        ENV_PREFIX, prog="python -m precompute_worker",
        description="InferScale precompute worker: leases facts from the memory service, computes their KV "
        f"(pre-RoPE keys, Context-Window Encoding) and uploads it. Flags also read {ENV_PREFIX}<FLAG>.")
    parser.add_options(WorkerOptions)
    return parser


def main(argv: Sequence[str] | None = None, encoder_factory: EncoderFactory | None = None) -> int:
    """Runs the worker; `encoder_factory(options, model_dir)` replaces the model's own encoder (speed runs only)."""
    parser = build_parser()
    options = parser.build(WorkerOptions, parser.parse_args(argv))
    if not options.model or not Path(options.model).is_dir():
        print(f"precompute_worker: --model: {options.model!r} is not a model folder", file=sys.stderr)
        return 2
    if options.context_window < -1:
        print("precompute_worker: --context-window: must be >= 0, or -1 for all preceding turns", file=sys.stderr)
        return 2
    configure_logging(options.log_level)
    log = structlog.get_logger("precompute_worker")
    import torch
    from transformers import AutoTokenizer

    if options.threads:
        torch.set_num_threads(options.threads)
    model_dir = Path(options.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    profile = build_model_profile(model_dir, tokenizer, options.kv_dtype or options.dtype, options.context_window,
                                  options.model_name)
    log.info("config", **dataclasses.asdict(options), profile_id=profile.profile_id)
    if encoder_factory is not None:
        encoder = encoder_factory(options, model_dir)
    else:
        encoder = FactEncoder.from_pretrained(model_dir, options.dtype, options.device, options.max_tokens_per_forward)
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    with memory_service_channel(options.memory_service, WORKER,
                                options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        worker = PrecomputeWorker(
            memory_pb2_grpc.MemoryServiceStub(channel), encoder, tokenizer, memory_header_ids(tokenizer), profile,
            options.worker_id, max_facts=options.max_facts, lease_seconds=options.lease_seconds,
            shared_encoding=options.encoding == "shared")
        grpc.channel_ready_future(channel).result(timeout=300)
        worker.announce()
        stats = worker.run(exit_when_idle=options.exit_when_idle, poll_interval_s=options.poll_interval_s,
                           stop=lambda: stopping)
    log.info("worker_stopped", facts_done=stats.facts_done, facts_failed=stats.facts_failed,
             facts_per_s=round(stats.facts_per_second, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
