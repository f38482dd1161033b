"""The KV pipeline through a real service: queueing, leases, completion, cascade, corruption, restart.

Workers are played by the test with synthetic blobs, to isolate the service; the real worker runs in
tests/precompute_worker/test_worker_end_to_end.py.
"""

import time
import urllib.request

import grpc
import pytest
import torch

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import KvBlobHeader, decode_kv_blob, encode_kv_blob
from inferscale_kv.kv_key import content_id
from inferscale_kv.layout import token_hash
from inferscale_kv.profile import kv_profile_id
from tests.stacks import UNAUDITED, ServerPool, Users

user = Users(__name__)
HEADER_IDS = (1, 2, 3)


@pytest.fixture(scope="module")
def memory_service(servers: ServerPool) -> MemoryServiceProcess:
    """The session's service without the sampled audit: these tests play several workers uploading made-up KV, which
    an audit would rightly withdraw (the audit's own tests: test_kv_audit.py)."""
    return servers.memory_service(*UNAUDITED)


def _profile(model: str) -> pb.KvProfile:
    profile = pb.KvProfile(model=model, model_hash="mh", kv_dtype="float32", tokenizer_hash="th",
                           header_hash=token_hash(HEADER_IDS), recipe="chunked-rope-cwe", recipe_version=1,
                           context_window=2)
    profile.profile_id = kv_profile_id(profile)
    return profile


def _announce(stub, model: str) -> pb.KvProfile:
    """A new profile, with the facts of earlier tests (queued by the announcement) already done."""
    profile = _profile(model)
    stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER, announcer_id="w"))
    while (lease := _lease(stub, profile, worker="drain")).items:
        _complete(stub, profile, lease, [_upload(profile, item) for item in lease.items], worker="drain")
    return profile


def _upload(profile: pb.KvProfile, item: pb.KvWorkItem, fill: float = 1.0) -> pb.FactKvUpload:
    tokens = len(item.text.split())
    header = KvBlobHeader(profile_id=profile.profile_id, user_id=item.user_id, fact_id=item.fact_id,
                          version=item.version, storage_dtype="float32", num_layers=2, num_tokens=tokens,
                          num_kv_heads=1, head_dim=4, token_ids=tuple(range(tokens)),
                          content_id=content_id(profile.profile_id, [], [int(fill * 1000), *range(tokens)]))
    keys = torch.full((2, tokens, 1, 4), fill)
    return pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                           blob=encode_kv_blob(header, keys, keys))


def _content_ids(stub, profile: pb.KvProfile, user_id: str) -> dict[str, str]:
    retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=user_id, query="fact", top_k=50,
                                                                 profile=profile, node_id="n1"))
    return {f.fact_id: f.content_id for f in retrieved.facts}


def _lease(stub, profile, worker="w1", max_facts=100, lease_seconds=60) -> pb.LeaseKvWorkResponse:
    return stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id=worker, profile_id=profile.profile_id,
                                                  max_facts=max_facts, lease_seconds=lease_seconds))


def _complete(stub, profile, lease, uploads, worker="w1") -> pb.CompleteKvWorkResponse:
    return stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id=worker,
                                                        profile_id=profile.profile_id, results=uploads))


def _profile_stats(stub, profile, user_id="") -> pb.ProfileKvStats:
    stats = stub.GetStats(pb.GetStatsRequest(user_id=user_id))
    return next(p for p in stats.profiles if p.profile_id == profile.profile_id)


def _ingest(stub, user_id: str, count: int = 3) -> None:
    stub.IngestTurns(pb.IngestTurnsRequest(user_id=user_id, turns=[
        pb.Turn(turn_id=f"t{i}", seq=i, speaker="A", text=f"turn {i}") for i in range(6)]))
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        pb.FactInput(fact_id=f"f{i}", text=f"fact number {i} of {user_id}", source_turn_id=f"t{i + 2}")
        for i in range(count)]))


def test_announcing_a_profile_queues_every_stored_fact(stub) -> None:
    _ingest(stub, user("kvp-announce"), count=3)
    profile = _profile("model-announce")
    first = stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, announcer_id="w"))
    again = stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, announcer_id="w"))
    assert first.facts_queued >= 3 and again.facts_queued == 0
    assert _profile_stats(stub, profile, user("kvp-announce")).queued == 3


def test_a_lease_carries_facts_and_their_preceding_turns(stub) -> None:
    profile = _announce(stub, "model-lease")
    _ingest(stub, user("kvp-lease"), count=2)
    lease = _lease(stub, profile)
    items = [i for i in lease.items if i.user_id == user("kvp-lease")]
    assert sorted(i.fact_id for i in items) == ["f0", "f1"]
    turns = next(u for u in lease.turns if u.user_id == user("kvp-lease")).turns
    assert [t.turn_id for t in turns] == ["t0", "t1", "t2", "t3"]  # up to the latest source turn (t3)
    assert _profile_stats(stub, profile, user("kvp-lease")).leased == 2


def test_completed_kv_is_ready_with_token_ids_and_fetchable(stub) -> None:
    profile = _announce(stub, "model-complete")
    _ingest(stub, user("kvp-complete"), count=3)
    lease = _lease(stub, profile)
    uploads = [_upload(profile, item) for item in lease.items]
    assert _complete(stub, profile, lease, uploads).accepted == len(uploads)
    retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=user("kvp-complete"), query="fact", top_k=10,
                                                                 profile=profile, node_id="n1"))
    assert len(retrieved.facts) == 3 and all(f.kv_ready and f.kv_bytes > 0 for f in retrieved.facts)
    assert all(list(f.token_ids) == list(range(len(f.text.split()))) for f in retrieved.facts)
    f1 = next(f for f in retrieved.facts if f.fact_id == "f1")
    fetched = list(stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=user("kvp-complete"),
                                                  facts=[pb.FactRef(fact_id="f1", version=1,
                                                                    content_id=f1.content_id)])))
    assert decode_kv_blob(fetched[0].blob).header.fact_id == "f1"
    unnamed = list(stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=user("kvp-complete"),
                                                  facts=[pb.FactRef(fact_id="f1", version=1)])))
    assert unnamed[0].blob == b""  # only what the index stores under exactly this name is served
    stats = _profile_stats(stub, profile, user("kvp-complete"))
    assert (stats.queued, stats.leased, stats.done) == (0, 0, 3)


def test_an_expired_lease_is_redelivered_to_another_worker(stub) -> None:
    profile = _announce(stub, "model-expiry")
    _ingest(stub, user("kvp-expiry"), count=2)
    first = _lease(stub, profile, worker="dies", lease_seconds=1)
    assert len(first.items) == 2
    assert not _lease(stub, profile, worker="other").items  # still leased
    time.sleep(1.2)
    second = _lease(stub, profile, worker="other")
    assert sorted(i.fact_id for i in second.items) == sorted(i.fact_id for i in first.items)
    done = _complete(stub, profile, second, [_upload(profile, i) for i in second.items], worker="other")
    assert done.accepted == 2


def test_a_duplicate_completion_is_harmless(stub) -> None:
    profile = _announce(stub, "model-duplicate")
    _ingest(stub, user("kvp-duplicate"), count=2)
    lease = _lease(stub, profile)
    uploads = [_upload(profile, item) for item in lease.items]
    assert _complete(stub, profile, lease, uploads).accepted == 2
    again = _complete(stub, profile, lease, uploads)
    assert (again.accepted, again.duplicates) == (0, 2)
    assert _profile_stats(stub, profile, user("kvp-duplicate")).done == 2


def test_a_changed_fact_gets_a_new_version_and_its_old_kv_is_dropped(stub) -> None:
    profile = _announce(stub, "model-version")
    _ingest(stub, user("kvp-version"), count=1)
    lease = _lease(stub, profile)
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("kvp-version"), facts=[
        pb.FactInput(fact_id="f0", text="a changed fact", source_turn_id="t2")]))
    stale = _complete(stub, profile, lease, [_upload(profile, i) for i in lease.items])
    assert (stale.accepted, stale.stale) == (0, 1)
    relet = _lease(stub, profile)
    assert [(i.fact_id, i.version, i.text) for i in relet.items] == [("f0", 2, "a changed fact")]


def test_deleting_facts_and_users_removes_their_kv_from_every_tier(stub) -> None:
    profile = _announce(stub, "model-cascade")
    _ingest(stub, user("kvp-cascade"), count=3)
    lease = _lease(stub, profile)
    _complete(stub, profile, lease, [_upload(profile, i) for i in lease.items])

    content_ids = _content_ids(stub, profile, user("kvp-cascade"))

    def kv_blobs(fact_ids):
        refs = [pb.FactRef(fact_id=f, version=1, content_id=content_ids[f]) for f in fact_ids]
        return [r.blob for r in stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id,
                                                               user_id=user("kvp-cascade"), facts=refs))]

    assert all(kv_blobs(["f0", "f1", "f2"]))  # fetched: the host cache holds them too
    tiers_before = {t.name: t.entries for t in stub.GetStats(pb.GetStatsRequest()).tiers}
    assert set(tiers_before) == {"host", "disk"}
    stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user("kvp-cascade"), fact_ids=["f0"]))
    assert [bool(b) for b in kv_blobs(["f0", "f1", "f2"])] == [False, True, True]
    stub.DeleteUser(pb.DeleteUserRequest(user_id=user("kvp-cascade")))
    assert not any(kv_blobs(["f1", "f2"]))
    tiers_after = {t.name: t.entries for t in stub.GetStats(pb.GetStatsRequest()).tiers}
    assert all(tiers_after[name] == tiers_before[name] - 3 for name in tiers_before)
    assert _profile_stats(stub, profile, user("kvp-cascade")).done == 0


def test_a_blob_for_another_fact_is_rejected(stub) -> None:
    profile = _announce(stub, "model-mismatch")
    _ingest(stub, user("kvp-mismatch"), count=2)
    lease = _lease(stub, profile)
    wrong = _upload(profile, lease.items[0])
    wrong.fact_id = lease.items[1].fact_id
    with pytest.raises(grpc.RpcError) as raised:
        _complete(stub, profile, lease, [wrong])
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_leasing_for_an_unknown_profile_is_not_found(stub) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="w", profile_id="kvp-never-announced"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_lease_longer_than_the_services_longest_is_refused_and_changes_nothing(stub) -> None:
    """The service's longest lease (--kv-lease-max-seconds, 600 by default) bounds how long a worker holds work."""
    profile = _announce(stub, "model-long-lease")
    _ingest(stub, user("kvp-long-lease"), count=2)
    for seconds in (601, 2**31 - 1):
        with pytest.raises(grpc.RpcError) as raised:
            _lease(stub, profile, worker="hoarder", lease_seconds=seconds)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith("lease_seconds:") and "600" in raised.value.details()
    stats = _profile_stats(stub, profile, user("kvp-long-lease"))
    assert (stats.queued, stats.leased) == (2, 0)
    assert "hoarder" not in {w.worker_id for w in stub.GetStats(pb.GetStatsRequest()).workers}
    lease = _lease(stub, profile, worker="patient", lease_seconds=600)
    assert sorted(i.fact_id for i in lease.items) == ["f0", "f1"]
    assert lease.expires_at.seconds <= time.time() + 601


def test_restart_restores_stored_kv_and_requeues_a_corrupted_blob(tmp_path) -> None:
    service = MemoryServiceProcess(tmp_path / "data", tmp_path / "log").start()
    with service.channel() as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        profile = _announce(stub, "model-restart")
        _ingest(stub, user("kvp-restart"), count=3)
        lease = _lease(stub, profile)
        _complete(stub, profile, lease, [_upload(profile, i) for i in lease.items])
        content_ids = _content_ids(stub, profile, user("kvp-restart"))
    service.stop()
    corrupted = next((tmp_path / "data" / "kv" / "blobs").rglob("f1.v1.*.kv"))
    corrupted.write_bytes(corrupted.read_bytes()[:-7] + b"garbage")

    restarted = MemoryServiceProcess(tmp_path / "data", tmp_path / "log").start()
    try:
        with restarted.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            disk = next(t for t in stub.GetStats(pb.GetStatsRequest()).tiers if t.name == "disk")
            assert disk.entries == 3
            refs = [pb.FactRef(fact_id=f"f{i}", version=1, content_id=content_ids[f"f{i}"]) for i in range(3)]
            blobs = [r.blob for r in stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id,
                                                                    user_id=user("kvp-restart"), facts=refs))]
            assert [bool(b) for b in blobs] == [True, False, True]
            assert decode_kv_blob(blobs[0]).header.fact_id == "f0"
            stats = _profile_stats(stub, profile, user("kvp-restart"))
            assert (stats.done, stats.queued) == (2, 1)
            assert [i.fact_id for i in _lease(stub, profile).items] == ["f1"]
    finally:
        restarted.stop()


def test_a_worker_completing_after_the_fact_was_recreated_stores_nothing(stub) -> None:
    """Regression: a lease on the old fact completed into the re-created fact (versions restarted at 1)."""
    profile = _announce(stub, "model-recreate")
    _ingest(stub, user("kvp-recreate"), count=1)
    old_lease = _lease(stub, profile, worker="slow")
    (old_item,) = old_lease.items
    stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user("kvp-recreate"), fact_ids=["f0"]))
    (recreated,) = stub.IngestFacts(pb.IngestFactsRequest(user_id=user("kvp-recreate"), facts=[
        pb.FactInput(fact_id="f0", text="a different fact now")])).facts
    assert recreated.version > old_item.version
    late = _complete(stub, profile, old_lease, [_upload(profile, old_item)], worker="slow")
    assert (late.accepted, late.stale) == (0, 1)
    retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=user("kvp-recreate"), query="fact", top_k=5,
                                                                 profile=profile, node_id="n1"))
    assert [(f.fact_id, f.version, f.kv_ready) for f in retrieved.facts] == [("f0", recreated.version, False)]
    (new_item,) = _lease(stub, profile).items
    assert (new_item.version, new_item.text) == (recreated.version, "a different fact now")


def test_fact_versions_are_never_handed_out_twice(stub) -> None:
    user_id = user("kvp-versions")
    versions = [stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        pb.FactInput(fact_id="f0", text="first text")])).facts[0].version]
    stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user_id, fact_ids=["f0"]))
    versions.append(stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        pb.FactInput(fact_id="f0", text="second text")])).facts[0].version)
    stub.DeleteUser(pb.DeleteUserRequest(user_id=user_id))
    versions.append(stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        pb.FactInput(fact_id="f0", text="third text"), pb.FactInput(fact_id="f9", text="other")])).facts[0].version)
    assert versions == sorted(set(versions)) and versions[0] == 1


def _header_blob(profile: pb.KvProfile, token_ids=HEADER_IDS) -> bytes:
    header = KvBlobHeader(profile_id=profile.profile_id, user_id="_profile", fact_id="header", version=1,
                          storage_dtype="float32", num_layers=2, num_tokens=len(token_ids), num_kv_heads=1, head_dim=4,
                          token_ids=tuple(token_ids), content_id=content_id(profile.profile_id, [], token_ids))
    keys = torch.full((2, len(token_ids), 1, 4), 0.5)
    return encode_kv_blob(header, keys, keys)


def test_the_header_kv_survives_disk_pressure_and_is_asked_for_again_when_lost(tmp_path) -> None:
    """Regression: the header was evicted from the disk tier first and nothing recreated it."""
    service = MemoryServiceProcess(tmp_path / "data", tmp_path / "log", "--kv-host-budget-mb", "0",
                                   "--kv-disk-budget-gb", str(3000 / (1 << 30))).start()  # room for ~10 blobs
    try:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            profile = _profile("model-header")
            # Announced by the worker that leases below: another worker would be asked for the header, to audit it.
            stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                           announcer_id="w1", header_kv=_header_blob(profile)))
            _ingest(stub, user("kvp-header"), count=20)
            lease = _lease(stub, profile)
            assert not lease.header_kv_wanted
            _complete(stub, profile, lease, [_upload(profile, i) for i in lease.items])
            header_id = content_id(profile.profile_id, [], HEADER_IDS)

            def header_blob() -> bytes:
                (reply,) = stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=user("kvp-header"),
                                                          include_header=True, header_content_id=header_id))
                return reply.blob

            assert header_blob() == _header_blob(profile)  # the disk tier evicted facts, never the header
            disk = next(t for t in stub.GetStats(pb.GetStatsRequest()).tiers if t.name == "disk")
            assert disk.evictions > 0 and disk.bytes <= disk.budget_bytes
            header_file = next((tmp_path / "data" / "kv" / "blobs").rglob("header.v1.*.kv"))
            header_file.write_bytes(b"torn")
            assert header_blob() == b""
            retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
                user_id=user("kvp-header"), query="fact", top_k=3, profile=profile, node_id="n1"))
            assert retrieved.header_content_id == ""  # the node serves the memory as text meanwhile
            assert _lease(stub, profile).header_kv_wanted
            stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, role=pb.PROFILE_ROLE_WORKER,
                                                           announcer_id="w1", header_kv=_header_blob(profile)))
            assert not _lease(stub, profile).header_kv_wanted and header_blob() == _header_blob(profile)
    finally:
        service.stop()


def test_a_workers_report_reaches_get_stats_and_the_metrics(stub, memory_service) -> None:
    profile = _announce(stub, "reporting")
    device = pb.WorkerDevice(name="NVIDIA H200", memory_total_bytes=150 << 30, memory_used_bytes=40 << 30,
                             utilization_percent=61)
    stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="gpu-worker-1", profile_id=profile.profile_id,
                                           facts_per_second=42.5, device=device))
    stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="cpu-worker-1", profile_id=profile.profile_id))
    workers = {w.worker_id: w for w in stub.GetStats(pb.GetStatsRequest()).workers}
    assert workers["gpu-worker-1"].facts_per_second == 42.5 and workers["gpu-worker-1"].device == device
    assert 0 <= workers["gpu-worker-1"].last_seen_seconds_ago < 60
    assert not workers["cpu-worker-1"].HasField("device") or workers["cpu-worker-1"].device.name == ""
    with urllib.request.urlopen(f"http://127.0.0.1:{memory_service.metrics_port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'inferscale_worker_facts_per_second{worker_id="gpu-worker-1"} 42.5' in metrics
    assert 'inferscale_worker_device_utilization_percent{worker_id="gpu-worker-1"} 61.0' in metrics
    assert 'inferscale_worker_device_utilization_percent{worker_id="cpu-worker-1"}' not in metrics
    for bad in (-1.0, float("nan")):
        with pytest.raises(grpc.RpcError) as error:
            stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="w", profile_id=profile.profile_id,
                                                   facts_per_second=bad))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "facts_per_second" in error.value.details()


def test_a_fetch_of_more_facts_than_a_request_may_retrieve_is_refused(stub) -> None:
    profile = _announce(stub, "model-fetch-cap")
    refs = [pb.FactRef(fact_id=f"f{index}", version=1, content_id="0" * 32) for index in range(1001)]
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=user("kvp-cap"), facts=refs)))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "facts" in raised.value.details()
