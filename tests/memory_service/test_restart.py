"""The data directory survives restarts, graceful or not."""

import signal

from harness.memory_service import MemoryServiceProcess
from harness.servers import wait_for_compactions
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc


def _ingest_and_stop(service: MemoryServiceProcess, sig: int) -> None:
    with service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        for batch in range(3):
            stub.IngestFacts(pb.IngestFactsRequest(user_id="restart-user", facts=[
                pb.FactInput(fact_id=f"b{batch}-{i}", text=f"Acknowledged fact {batch}/{i}") for i in range(10)
            ]))
        stub.IngestTurns(pb.IngestTurnsRequest(user_id="restart-user",
                                               turns=[pb.Turn(turn_id="D1:1", seq=1, text="hi")]))
    service.stop(sig)


def _assert_all_there(service: MemoryServiceProcess) -> None:
    with service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        stats = stub.GetStats(pb.GetStatsRequest(user_id="restart-user"))
        assert (stats.facts, stats.turns) == (30, 1)
        top = stub.SearchFacts(pb.SearchFactsRequest(user_id="restart-user", query="Acknowledged fact 2/7", top_k=1))
        assert top.facts[0].fact.fact_id == "b2-7"


def test_graceful_restart_keeps_every_fact_and_turn(tmp_path) -> None:
    service = MemoryServiceProcess(tmp_path / "data", tmp_path / "log").start()
    _ingest_and_stop(service, signal.SIGTERM)
    assert service.process.returncode == 0
    restarted = MemoryServiceProcess(tmp_path / "data", tmp_path / "log").start()
    try:
        _assert_all_there(restarted)
    finally:
        restarted.stop()


def test_acknowledged_facts_survive_kill_9(tmp_path) -> None:
    service = MemoryServiceProcess(tmp_path / "data", tmp_path / "log").start()
    _ingest_and_stop(service, signal.SIGKILL)
    restarted = MemoryServiceProcess(tmp_path / "data", tmp_path / "log").start()
    try:
        _assert_all_there(restarted)
    finally:
        restarted.stop()


def test_a_burst_of_writes_is_compacted_without_waiting_for_the_interval(tmp_path) -> None:
    """An uncached user's read scans every write not yet folded into the user index; a bulk import must not leave
    them for the next --optimize-interval-s (the full load test's warm-up timed out reading 1,000 such users)."""
    service = MemoryServiceProcess(tmp_path / "data", tmp_path / "log", "--optimize-interval-s", "3600",
                                   "--optimize-after-writes", "3").start()
    try:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            for batch in range(3):
                stub.IngestFacts(pb.IngestFactsRequest(user_id=f"bulk-{batch}", facts=[pb.FactInput(text="a fact")]))
        wait_for_compactions([service], [0], timeout_s=30)  # raises TimeoutError without a compaction
    finally:
        service.stop()
