"""Three memory-service replicas on one real PostgreSQL (coordination) and one real S3-compatible store (SeaweedFS:
facts, turns, embeddings and fact KV), all on loopback: any replica serves any user, a write acknowledged by one is
seen by the next call on another, concurrent writes of the same facts never duplicate, deletes reach every replica's
tiers and the object store, a killed replica loses nothing acknowledged and its callers fail over, and a lease taken
through one replica is completed through another."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from harness.memory_service import MemoryServiceProcess
from harness.servers import memory_service_replicas
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.call_credentials import WORKER, memory_service_channel
from inferscale_kv.layout import fact_token_ids
from tests.conftest import run_worker
from tests.inference_node.conftest import random_kv, tiny_profile, upload_custom_kv

BUCKET = "inferscale-replicas"
SWEEP_S = 1.0


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    # Without the sampled KV audit: a test here uploads made-up KV, which an audit would rightly withdraw and whose
    # audit would show in another test's lease.
    with memory_service_replicas(tmp_path_factory.mktemp("replicas"), 3, "--tier-sweep-interval-s", str(SWEEP_S),
                                 "--kv-host-budget-mb", "64", "--kv-lease-seconds", "2", "--kv-audit-share", "0",
                                 bucket=BUCKET) as replicas:
        yield replicas


@pytest.fixture(scope="module")
def replicas(deployed):
    return deployed.services


@pytest.fixture(scope="module")
def stubs(replicas):
    channels = [replica.channel() for replica in replicas]
    yield [memory_pb2_grpc.MemoryServiceStub(channel) for channel in channels]
    for channel in channels:
        channel.close()


def _fact_ids(stub, user_id: str) -> list[str]:
    return [fact.fact_id for fact in stub.ListFacts(pb.ListFactsRequest(user_id=user_id, page_size=1000)).facts]


def _search_ids(stub, user_id: str, query: str = "garden") -> set[str]:
    return {scored.fact.fact_id for scored in
            stub.SearchFacts(pb.SearchFactsRequest(user_id=user_id, query=query, top_k=100)).facts}


def test_a_write_acknowledged_by_one_replica_is_seen_by_the_next_call_on_another(stubs) -> None:
    for writer, reader in ((0, 1), (1, 2), (2, 0)):
        user = f"seen-{writer}-{reader}"
        stubs[writer].IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
            pb.FactInput(fact_id="old", text="Nora waters the garden at six.")]))
        assert _search_ids(stubs[reader], user) == {"old"}  # the reader now caches the user
        stubs[writer].IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
            pb.FactInput(fact_id="new", text="Nora planted tulips in the garden.")]))
        assert _search_ids(stubs[reader], user) == {"old", "new"}
        stubs[writer].DeleteFacts(pb.DeleteFactsRequest(user_id=user, fact_ids=["old"]))
        assert _search_ids(stubs[reader], user) == {"new"}
        updated = stubs[writer].IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
            pb.FactInput(fact_id="new", text="Nora planted roses in the garden.")])).facts[0]
        (fact,) = stubs[reader].SearchFacts(pb.SearchFactsRequest(user_id=user, query="roses", top_k=5)).facts
        assert (fact.fact.text, fact.fact.version) == ("Nora planted roses in the garden.", updated.version)


def test_every_retrieval_mode_ranks_alike_on_every_replica_and_keyword_search_runs_on_the_object_store(stubs) -> None:
    user = "ranks-alike"
    texts = ["Nora waters the garden at six.", "Nora planted tulips in the garden.", "Ben repairs bikes in the garden.",
             "Order GX-4410 arrived on Monday.", "Nora waters the garden at six."]  # the last a tie of the first
    for index, text in enumerate(texts):  # one per call through each replica in turn: every replica merges writes
        stubs[index % len(stubs)].IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
            pb.FactInput(fact_id=f"f{index}", text=text)]))
    question = "When does Nora water the garden, and has GX-4410 come?"
    for mode in (pb.RETRIEVAL_MODE_VECTOR, pb.RETRIEVAL_MODE_KEYWORD, pb.RETRIEVAL_MODE_HYBRID):
        answers = [[(scored.fact.fact_id, scored.rank) for scored in stub.SearchFacts(pb.SearchFactsRequest(
            user_id=user, query=question, top_k=5, retrieval=mode)).facts] for stub in stubs]
        assert answers[0] and all(answer == answers[0] for answer in answers), (mode, answers)
    keyword = stubs[1].SearchFacts(pb.SearchFactsRequest(user_id=user, query="GX-4410",
                                                         retrieval=pb.RETRIEVAL_MODE_KEYWORD))
    assert [scored.fact.fact_id for scored in keyword.facts] == ["f3"]
    stubs[2].DeleteFacts(pb.DeleteFactsRequest(user_id=user, fact_ids=["f3"]))
    for stub in stubs:
        assert not stub.SearchFacts(pb.SearchFactsRequest(user_id=user, query="GX-4410",
                                                          retrieval=pb.RETRIEVAL_MODE_KEYWORD)).facts


def test_the_same_facts_ingested_through_every_replica_at_once_are_stored_once(stubs) -> None:
    facts = [pb.FactInput(fact_id=f"f{i}", text=f"Fact {i}: the garden gate is painted color {i}.") for i in range(20)]
    outcomes: list[int] = []
    barrier = threading.Barrier(6)

    def ingest(stub) -> None:
        barrier.wait()
        response = stub.IngestFacts(pb.IngestFactsRequest(user_id="racer", facts=facts))
        outcomes.extend(fact.outcome for fact in response.facts)

    threads = [threading.Thread(target=ingest, args=(stub,)) for stub in stubs * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count(pb.INGEST_OUTCOME_CREATED) == 20  # each fact created once, by one of the six calls
    for stub in stubs:
        ids = _fact_ids(stub, "racer")
        assert sorted(ids) == sorted(f.fact_id for f in facts)  # no duplicate rows
        assert {fact.version for fact in stub.ListFacts(pb.ListFactsRequest(user_id="racer")).facts} == {1}


def _metric(replica: MemoryServiceProcess, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(f"{name}{labels}"))


def _object_users(deployed) -> set[str]:
    listing = deployed.s3.client().list_objects_v2(Bucket=BUCKET, Prefix="service/kv/")
    return {item["Key"].split("/")[3] for item in listing.get("Contents", [])}


def test_delete_user_through_one_replica_removes_facts_and_kv_from_every_replica_and_the_store(
        replicas, stubs, deployed, tiny_llama_dir) -> None:
    facts = [pb.FactInput(fact_id=f"g{i}", text=f"Gus keeps {i} goldfish in a pond by the garden.") for i in range(4)]
    stubs[0].IngestFacts(pb.IngestFactsRequest(user_id="gus", facts=facts))
    run_worker(replicas[0], tiny_llama_dir)  # announces the profile and stores every fact's KV
    profile = tiny_profile(tiny_llama_dir)
    host_entries = []
    for stub, replica in zip(stubs, replicas, strict=True):  # every replica's host tier gets the user's KV
        retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
            user_id="gus", query="goldfish", top_k=10, profile=profile, node_id="test"))
        assert all(fact.kv_ready for fact in retrieved.facts) and len(retrieved.facts) == 4
        refs = [pb.FactRef(fact_id=f.fact_id, version=f.version, content_id=f.content_id) for f in retrieved.facts]
        assert all(reply.blob for reply in stub.FetchKv(pb.FetchKvRequest(
            profile_id=profile.profile_id, user_id="gus", facts=refs)))
        host_entries.append(_metric(replica, "inferscale_kv_tier_entries", '{tier="host"}'))
    assert "gus" in _object_users(deployed)
    stubs[2].DeleteUser(pb.DeleteUserRequest(user_id="gus"))
    for stub in stubs:
        assert _fact_ids(stub, "gus") == [] and _search_ids(stub, "gus", "goldfish") == set()
        assert [reply.blob for reply in stub.FetchKv(pb.FetchKvRequest(
            profile_id=profile.profile_id, user_id="gus", facts=refs))] == [b""] * 4
    assert "gus" not in _object_users(deployed)
    time.sleep(3 * SWEEP_S)
    for replica, before in zip(replicas, host_entries, strict=True):
        assert _metric(replica, "inferscale_kv_tier_entries", '{tier="host"}') == before - 4


def test_a_worker_completes_through_another_replica_than_it_leased_from(stubs, replicas, tiny_llama_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    profile = tiny_profile(tiny_llama_dir)
    stubs[1].IngestFacts(pb.IngestFactsRequest(user_id="hana", facts=[
        pb.FactInput(fact_id="h0", text="Hana flies kites over the garden.")]))
    retrieve = pb.RetrieveAndStageRequest(user_id="hana", query="kites", top_k=5, profile=profile, node_id="test")
    # Replica 2 answers first, KV not ready: its copy of the KV index holds that until the completion (made through
    # replica 1) moves the user's KV generation.
    (before,) = stubs[2].RetrieveAndStage(retrieve).facts
    assert not before.kv_ready
    accepted = upload_custom_kv(stubs[0], profile, "hana", lambda item: (
        *random_kv(len(fact_token_ids(tokenizer, item.text)), 3), fact_token_ids(tokenizer, item.text)),
        complete_stub=stubs[1])
    assert accepted == 1
    (fact,) = stubs[2].RetrieveAndStage(retrieve).facts
    assert fact.kv_ready


def _ingest_calls(replica) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{replica.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('inferscale_rpc_requests_total{') and 'method="IngestFacts"' in line)


def test_the_python_client_given_every_replica_spreads_its_calls_over_them(deployed, replicas) -> None:
    """The client package (clients/python) on the address naming every replica, as an app in Kubernetes has it
    (dns:///...): its calls go round robin, and what one replica acknowledged the next page from another lists."""
    from inferscale_client import MemoryClient

    before = [_ingest_calls(replica) for replica in replicas]
    with MemoryClient(memory_service=deployed.address, timeout_s=60) as client:
        texts = [f"Client fact {index} about the orchard." for index in range(60)]
        assert len(client.add_facts("client-user", texts, batch_size=10)) == 60
        assert sorted(fact.text for fact in client.list_facts("client-user", page_size=7)) == sorted(texts)
        assert client.delete_user("client-user").facts_deleted == 60  # and its KV jobs: later tests lease none
    assert all(_ingest_calls(replica) > calls for replica, calls in zip(replicas, before, strict=True))


def test_kill_9_of_a_replica_loses_no_acknowledged_fact_and_its_callers_fail_over(
        deployed, replicas, stubs, tiny_llama_dir) -> None:
    profile = tiny_profile(tiny_llama_dir)
    # A lease taken through the replica about to die: it must expire and be redone through another.
    stubs[0].IngestFacts(pb.IngestFactsRequest(user_id="leased", facts=[
        pb.FactInput(fact_id=f"l{i}", text=f"Lia counts {i} herons at the lake.") for i in range(3)]))
    lease = stubs[2].LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="doomed", profile_id=profile.profile_id,
                                                       max_facts=64, lease_seconds=2))
    assert {item.user_id for item in lease.items} == {"leased"}
    acknowledged: list[str] = []
    errors: list[str] = []
    retrievals = [0]
    stop = threading.Event()
    channel = memory_service_channel(deployed.address, WORKER)
    client = memory_pb2_grpc.MemoryServiceStub(channel)

    def ingest_stream() -> None:
        batch = 0
        while not stop.is_set():
            ids = [f"s{batch}-{i}" for i in range(3)]
            try:
                client.IngestFacts(pb.IngestFactsRequest(user_id="stream", facts=[
                    pb.FactInput(fact_id=fact_id, text=f"Stream fact {fact_id} about the garden.")
                    for fact_id in ids]), timeout=30)
                acknowledged.extend(ids)
            except grpc.RpcError as error:
                errors.append(f"IngestFacts {error.code().name}")
            batch += 1

    def retrieve_stream() -> None:
        while not stop.is_set():
            try:
                client.RetrieveAndStage(pb.RetrieveAndStageRequest(
                    user_id="stream", query="garden", top_k=5, profile=profile, node_id="test"), timeout=30)
                retrievals[0] += 1
            except grpc.RpcError as error:
                errors.append(f"RetrieveAndStage {error.code().name}")

    threads = [threading.Thread(target=ingest_stream), threading.Thread(target=retrieve_stream)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    replicas[2].stop(signal.SIGKILL)
    time.sleep(4)
    stop.set()
    for thread in threads:
        thread.join()
    channel.close()
    assert errors == []
    assert len(acknowledged) > 9 and retrievals[0] > 5
    for stub in stubs[:2]:
        assert set(acknowledged) <= set(_fact_ids(stub, "stream"))
    time.sleep(2)  # the dead replica's lease expires: a worker through the others redoes its facts
    run_worker(replicas[0], tiny_llama_dir)
    stats = {p.profile_id: p for p in stubs[1].GetStats(pb.GetStatsRequest(user_id="leased")).profiles}
    assert stats[profile.profile_id].done == 3 and stats[profile.profile_id].queued == 0
    assert json.dumps(sorted(_fact_ids(stubs[1], "leased"))) == json.dumps(["l0", "l1", "l2"])
