"""A rejected call changes nothing, through a real memory service process: a RetrieveAndStage rejected for any one
of its fields registers no profile and queues no KV work, as GetStats and the coordination store itself (the SQLite
file under the data directory) tell; a CompleteKvWork rejected for one of its blobs stores none of them; a
LeaseKvWork for a profile never announced records no worker.

Regression: RetrieveAndStage announced the caller's profile (queueing every stored fact for it) before it checked
the query, so calls answered INVALID_ARGUMENT for their query or query vector registered the profile and queued the
user's facts."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import KvBlobHeader, encode_kv_blob
from inferscale_kv.kv_key import content_id
from inferscale_kv.profile import kv_profile_id
from memory_service.config import Limits
from tests.conftest import own_memory_service

USER = "rejected-user"
FACTS = 5
LIMITS = Limits()
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _profile(name: str, **overrides) -> pb.KvProfile:
    profile = pb.KvProfile(model=name, model_hash="mh", kv_dtype="float32", tokenizer_hash="th", header_hash="hh",
                           recipe="chunked-rope-cwe", recipe_version=1, context_window=0)
    profile.profile_id = kv_profile_id(profile)
    for name, value in overrides.items():  # after the id: a profile whose fields no longer match it
        setattr(profile, name, value)
    return profile


def _request(case: str, model_id: str, **fields) -> pb.RetrieveAndStageRequest:
    """A valid request for `case`'s own profile (so that no case sees another's), with `fields` made invalid; a
    query vector is sent as the service's model's (`model_id`) unless `embedding_model_id` says otherwise."""
    request = {"user_id": USER, "query": "Where does she walk her dog?", "top_k": 3, "node_id": "node-0",
               "profile": _profile(f"model-{case}"), **fields}
    if "query_vector" in fields:
        request.setdefault("embedding_model_id", model_id)
    return pb.RetrieveAndStageRequest(**request)


# (case, the request's invalid fields, the status, the field the message names first)
CASES = [
    ("empty-user", {"user_id": ""}, INVALID, "user_id"),
    ("bad-user", {"user_id": "has space"}, INVALID, "user_id"),
    ("negative-top-k", {"top_k": -1}, INVALID, "top_k"),
    ("huge-top-k", {"top_k": LIMITS.max_top_k + 1}, EXHAUSTED, "top_k"),
    ("no-profile", {"profile": pb.KvProfile()}, INVALID, "profile.model"),
    ("profile-without-model", {"profile": _profile("model-x", model="")}, INVALID, "profile.model"),
    ("profile-kv-dtype", {"profile": _profile("model-x", kv_dtype="int3")}, INVALID, "profile.kv_dtype"),
    ("profile-recipe-version", {"profile": _profile("model-x", recipe_version=0)}, INVALID, "profile.recipe_version"),
    ("profile-window", {"profile": _profile("model-x", context_window=-2)}, INVALID, "profile.context_window"),
    ("stale-profile-id", {"profile": _profile("model-x", context_window=5)}, INVALID, "profile.profile_id"),
    ("empty-node", {"node_id": ""}, INVALID, "node_id"),
    ("bad-node", {"node_id": "node 0"}, INVALID, "node_id"),
    ("empty-query", {"query": ""}, INVALID, "query"),
    ("blank-query", {"query": " \n\t"}, INVALID, "query"),
    ("nul-query", {"query": "a\x00b"}, INVALID, "query"),
    ("long-query", {"query": "q" * (LIMITS.max_query_chars + 1)}, EXHAUSTED, "query"),
    ("short-vector", {"query_vector": [1.0] * 383}, INVALID, "query_vector"),
    ("zero-vector", {"query_vector": [0.0] * 384}, INVALID, "query_vector"),
    ("nan-vector", {"query_vector": [float("nan")] * 384}, INVALID, "query_vector"),
    ("vector-of-another-model", {"query_vector": [1.0] * 384, "embedding_model_id": "other-model@1"}, INVALID,
     "embedding_model_id"),
    ("vector-without-model", {"query_vector": [1.0] * 384, "embedding_model_id": ""}, INVALID,
     "embedding_model_id"),
]


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MemoryServiceProcess]:
    """A service of this module's own (its checks read the whole coordination store), whose one user holds FACTS
    facts."""
    with own_memory_service(tmp_path_factory, "rejected") as service:
        with service.channel() as channel:
            memory_pb2_grpc.MemoryServiceStub(channel).IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[
                pb.FactInput(fact_id=f"f{i}", text=f"Fact {i}: she walks her dog along the river.")
                for i in range(FACTS)]))
        yield service


@pytest.fixture(scope="module")
def model_id(stub) -> str:
    return stub.GetStats(pb.GetStatsRequest()).embedding_model_id


def _coordination_rows(memory_service: MemoryServiceProcess) -> tuple[list[tuple], list[tuple]]:
    """The coordination store's profiles and jobs, read from its SQLite file."""
    path = Path(memory_service.data_dir) / "kv" / "index.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as database:
        profiles = database.execute("SELECT profile_id FROM profiles").fetchall()
        jobs = database.execute("SELECT profile_id, user_id, fact_id FROM jobs").fetchall()
    database.close()
    return profiles, jobs


def _registered(stub, memory_service: MemoryServiceProcess) -> tuple[list[str], int, list[tuple], list[tuple]]:
    """Profiles and work as GetStats reports them (profile ids, facts queued for USER) and as stored."""
    profiles = stub.GetStats(pb.GetStatsRequest(user_id=USER)).profiles
    return [p.profile_id for p in profiles], sum(p.queued for p in profiles), *_coordination_rows(memory_service)


@pytest.mark.parametrize(("case", "fields", "code", "field"), CASES, ids=[case[0] for case in CASES])
def test_a_rejected_retrieve_and_stage_registers_no_profile_and_queues_no_work(stub, memory_service, model_id, case,
                                                                               fields, code, field) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        stub.RetrieveAndStage(_request(case, model_id, **fields))
    assert raised.value.code() == code, raised.value.details()
    assert raised.value.details().startswith(field), raised.value.details()
    assert _registered(stub, memory_service) == ([], 0, [], [])


def test_an_accepted_retrieve_and_stage_registers_its_profile_and_queues_the_users_facts(stub, memory_service,
                                                                                        model_id) -> None:
    """The check above can see a registration: a valid call makes one."""
    assert _registered(stub, memory_service) == ([], 0, [], [])
    request = _request("accepted", model_id)
    assert len(stub.RetrieveAndStage(request).facts) == 3
    profile_ids, queued, profiles, jobs = _registered(stub, memory_service)
    assert profile_ids == [request.profile.profile_id] and profiles == [(request.profile.profile_id,)]
    assert queued == FACTS and len(jobs) == FACTS


def _upload(profile_id: str, item: pb.KvWorkItem, **header_fields) -> pb.FactKvUpload:
    fields = {"profile_id": profile_id, "user_id": item.user_id, "fact_id": item.fact_id, "version": item.version,
              **header_fields}
    header = KvBlobHeader(**fields, storage_dtype="float32", num_layers=1, num_tokens=2, num_kv_heads=1, head_dim=4,
                          token_ids=(1, 2), content_id=content_id(profile_id, [], [1, 2]))
    keys = torch.ones((1, 2, 1, 4))
    return pb.FactKvUpload(user_id=item.user_id, fact_id=item.fact_id, version=item.version,
                           blob=encode_kv_blob(header, keys, keys))


def test_a_complete_kv_work_rejected_for_one_blob_stores_none_of_them(stub) -> None:
    profile = _profile("model-complete")
    stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=profile, announcer_id="w"))
    lease = stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="w", profile_id=profile.profile_id, max_facts=FACTS))
    assert len(lease.items) == FACTS
    uploads = [_upload(profile.profile_id, item) for item in lease.items]
    uploads[-1] = _upload(profile.profile_id, lease.items[-1], fact_id="another-fact")
    with pytest.raises(grpc.RpcError) as raised:
        stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id="w",
                                                     profile_id=profile.profile_id, results=uploads))
    assert raised.value.code() == INVALID and raised.value.details().startswith(f"results[{FACTS - 1}].blob")
    (stats,) = [p for p in stub.GetStats(pb.GetStatsRequest(user_id=USER)).profiles
                if p.profile_id == profile.profile_id]
    assert (stats.done, stats.leased) == (0, FACTS)
    accepted = stub.CompleteKvWork(pb.CompleteKvWorkRequest(lease_id=lease.lease_id, worker_id="w",
                                                            profile_id=profile.profile_id, results=uploads[:-1]))
    assert accepted.accepted == FACTS - 1  # the check above could see stored KV


def test_a_lease_for_a_profile_never_announced_records_no_worker(stub) -> None:
    never_announced = _profile("model-never-announced")
    with pytest.raises(grpc.RpcError) as raised:
        stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="lost-worker", profile_id=never_announced.profile_id,
                                               facts_per_second=3.0))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert "lost-worker" not in {w.worker_id for w in stub.GetStats(pb.GetStatsRequest()).workers}
    stub.AnnounceProfile(pb.AnnounceProfileRequest(profile=never_announced, announcer_id="w"))
    stub.LeaseKvWork(pb.LeaseKvWorkRequest(worker_id="lost-worker", profile_id=never_announced.profile_id))
    assert "lost-worker" in {w.worker_id for w in stub.GetStats(pb.GetStatsRequest()).workers}
