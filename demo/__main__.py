"""`make demo`: starts a memory service, ingests the sample conversation, answers retrieval queries, stops."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from demo.conversation import load_conversation
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from memory_service.launcher import MemoryServiceProcess

INGEST_BATCH = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--top-k", type=int, default=3)
    args = parser.parse_args()
    conversation = load_conversation()

    with tempfile.TemporaryDirectory(prefix="inferscale-demo-") as workdir:
        print("starting the memory service (loads LanceDB and the embedding model) ...", flush=True)
        started = time.perf_counter()
        service = MemoryServiceProcess(Path(workdir) / "data", Path(workdir) / "memory_service.log").start()
        print(f"memory service SERVING on {service.address} after {time.perf_counter() - started:.1f}s")
        try:
            with service.channel() as channel:
                stub = memory_pb2_grpc.MemoryServiceStub(channel)
                stub.IngestTurns(pb.IngestTurnsRequest(user_id=conversation.user_id, turns=conversation.turns))
                with tqdm(total=len(conversation.facts), desc="ingesting facts", unit="fact") as progress:
                    for start in range(0, len(conversation.facts), INGEST_BATCH):
                        batch = conversation.facts[start : start + INGEST_BATCH]
                        stub.IngestFacts(pb.IngestFactsRequest(user_id=conversation.user_id, facts=batch))
                        progress.update(len(batch))

                print(f"\n{'question':<40} {'top fact':<70} {'evidence':>8} {'ms':>6}")
                for question in conversation.questions:
                    asked = time.perf_counter()
                    response = stub.SearchFacts(
                        pb.SearchFactsRequest(user_id=conversation.user_id, query=question.question, top_k=args.top_k)
                    )
                    elapsed_ms = (time.perf_counter() - asked) * 1000
                    found = {scored.fact.fact_id for scored in response.facts}
                    hit = "yes" if set(question.evidence) <= found else "no"
                    print(f"{question.question:<40} {response.facts[0].fact.text[:68]:<70} {hit:>8} {elapsed_ms:6.1f}")

                stats = stub.GetStats(pb.GetStatsRequest())
                print(f"\nstored: {stats.users} user, {stats.facts} facts, {stats.turns} turns "
                      f"({stats.embedding_model}, {stats.embedding_dim}-d)")
        finally:
            service.stop()
            print("memory service stopped")


if __name__ == "__main__":
    main()
