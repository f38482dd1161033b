"""A small chat loop with memory: each of the user's turns is stored (with the facts the app takes from it) through
the InferScale client, and each question goes to an inference node through the OpenAI SDK with
`extra_body={"memory": ...}`; the node says what it did with the memory in the `x-inferscale-memory` header.

    python examples/chat_with_memory.py --memory-service 127.0.0.1:50051 --node http://127.0.0.1:8000 \\
        --model MODEL --user maya

Reads lines from standard input: `remember: <fact>` stores a fact, anything else is a question (answered with the
user's memory as KV). `--script FILE` reads the lines from a file instead. Needs `pip install clients/python openai`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Iterable, Iterator

from openai import OpenAI

from inferscale_client import MemoryClient

REMEMBER = "remember:"


def chat(memory: MemoryClient, llm: OpenAI, model: str, user: str, lines: Iterable[str], mode: str = "kv",
         max_tokens: int = 32) -> Iterator[dict]:
    """Runs the lines as they come; one record per line: what was stored, or the answer and the memory summary.
    Each line is a turn of its own (a new id; ordered by the time it was said, across runs)."""
    session = uuid.uuid4().hex[:8]
    for line in (line.strip() for line in lines):
        if not line:
            continue
        turn_id = f"turn-{uuid.uuid4().hex[:12]}"
        memory.add_turns(user, [{"turn_id": turn_id, "seq": time.time_ns() // 1000, "session_id": session,
                                 "speaker": user, "text": line}])
        if line.lower().startswith(REMEMBER):
            fact = line[len(REMEMBER):].strip()
            (stored,) = memory.add_facts(user, [{"text": fact, "source_turn_id": turn_id}])
            yield {"stored": fact, "fact_id": stored.fact_id}
            continue
        raw = llm.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": line}], max_tokens=max_tokens, temperature=0,
            extra_body={"memory": {"user_id": user, "mode": mode}})
        answer = raw.parse().choices[0].message.content or ""
        yield {"question": line, "answer": answer, "memory": json.loads(raw.headers.get("x-inferscale-memory") or "{}")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-service", default="127.0.0.1:50051")
    parser.add_argument("--node", default="http://127.0.0.1:8000", help="the inference node's (or router's) URL")
    parser.add_argument("--model", required=True, help="the node's served model name")
    parser.add_argument("--user", default="maya")
    parser.add_argument("--mode", default="kv", choices=("kv", "text", "off"))
    parser.add_argument("--script", type=argparse.FileType(), default=sys.stdin, help="lines to run")
    args = parser.parse_args(argv)
    with MemoryClient(memory_service=args.memory_service) as memory:
        llm = OpenAI(base_url=f"{args.node}/v1", api_key="unused")
        for record in chat(memory, llm, args.model, args.user, args.script, args.mode):
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
