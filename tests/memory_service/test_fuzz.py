"""Fuzzing every RPC of a real memory service with generated messages (hypothesis): oversize, empty and unicode-edge
fields, wrong ids, huge and negative numbers, malformed batches. Every call must end in OK or a clear client-error
status with a message; a rejected call must leave the named user's facts as they were; the service must stay up and
a bystander user's facts must survive the whole run."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferscale.v1 import memory_pb2 as pb

CASES_PER_RPC = 60
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS}
BYSTANDER = "fuzz-bystander"
CASES: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()

# Unicode edges: NUL and control characters, bidi marks, combining marks, astral emoji; never lone surrogates
# (protobuf cannot carry them, so no client can send them).
edgy_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40) | st.sampled_from(
    ["", " ", "\x00", "\u202e\u2066", "e\u0301\u0301\u0301", "😀" * 20, "a/../b", "'; DROP TABLE facts; --",
     "user\nid", "\ufeff"])
oversize_text = st.integers(min_value=1_000, max_value=300_000).map(lambda size: "x" * size)
any_text = edgy_text | oversize_text
any_int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
any_int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# Two of three ids are valid, so calls get past id validation into the deeper paths.
valid_user_ids = st.sampled_from(["fuzz-a", "fuzz-b", "fuzz-c"])
user_ids = valid_user_ids | valid_user_ids | edgy_text.filter(lambda user: user != BYSTANDER)
timestamps = st.builds(Timestamp, seconds=st.integers(min_value=-(2**40), max_value=2**40),
                       nanos=st.integers(min_value=0, max_value=999_999_999))
metadata = st.dictionaries(edgy_text, any_text, max_size=40)
fact_inputs = st.builds(pb.FactInput, fact_id=edgy_text, text=any_text, source_turn_id=edgy_text,
                        timestamp=timestamps, metadata=metadata)
# Batches: a few generated facts, or a great many copies (past the batch limit).
fact_batches = st.lists(fact_inputs, max_size=6) | st.integers(min_value=0, max_value=20_000).map(
    lambda size: [pb.FactInput(text=f"fact {index}") for index in range(size)])
turns = st.builds(pb.Turn, turn_id=edgy_text, seq=any_int64, session_id=edgy_text, speaker=edgy_text, text=any_text,
                  timestamp=timestamps)
profiles = st.builds(pb.KvProfile, profile_id=edgy_text, model=any_text, model_hash=edgy_text, kv_dtype=edgy_text,
                     tokenizer_hash=edgy_text, header_hash=edgy_text, recipe=edgy_text, recipe_version=any_int32,
                     context_window=any_int32)
fact_ids = st.lists(edgy_text, max_size=6) | st.integers(min_value=0, max_value=50_000).map(
    lambda size: [f"id-{index}" for index in range(size)])

REQUESTS = {
    "IngestFacts": st.builds(pb.IngestFactsRequest, user_id=user_ids, facts=fact_batches, request_id=edgy_text),
    "IngestTurns": st.builds(pb.IngestTurnsRequest, user_id=user_ids, turns=st.lists(turns, max_size=5)),
    "SearchFacts": st.builds(pb.SearchFactsRequest, user_id=user_ids, query=any_text, top_k=any_int32),
    "ListFacts": st.builds(pb.ListFactsRequest, user_id=user_ids, page_size=any_int32, page_token=any_text),
    "DeleteFacts": st.builds(pb.DeleteFactsRequest, user_id=user_ids, fact_ids=fact_ids),
    "DeleteUser": st.builds(pb.DeleteUserRequest, user_id=user_ids),
    "GetStats": st.builds(pb.GetStatsRequest, user_id=user_ids),
    "RetrieveAndStage": st.builds(pb.RetrieveAndStageRequest, user_id=user_ids, query=any_text, top_k=any_int32,
                                  profile=profiles, node_id=edgy_text),
    "AnnounceProfile": st.builds(pb.AnnounceProfileRequest, profile=profiles, role=st.integers(0, 5),
                                 announcer_id=edgy_text, header_kv=st.binary(max_size=256)),
    "LeaseKvWork": st.builds(pb.LeaseKvWorkRequest, worker_id=edgy_text, profile_id=edgy_text, max_facts=any_int32,
                             lease_seconds=any_int32),
    "CompleteKvWork": st.builds(
        pb.CompleteKvWorkRequest, lease_id=edgy_text, worker_id=edgy_text, profile_id=edgy_text,
        results=st.lists(st.builds(pb.FactKvUpload, user_id=user_ids, fact_id=edgy_text, version=any_int64,
                                   blob=st.binary(max_size=512)), max_size=4)),
    "FetchKv": st.builds(pb.FetchKvRequest, profile_id=edgy_text, user_id=user_ids,
                         facts=st.lists(st.builds(pb.FactRef, fact_id=edgy_text, version=any_int64), max_size=5),
                         include_header=st.booleans()),
}


def _facts_of(stub, user_id: str) -> list[tuple[str, int, str]] | None:
    """The user's facts, or None when the id itself is one the service refuses."""
    try:
        listed = stub.ListFacts(pb.ListFactsRequest(user_id=user_id, page_size=1000), timeout=30)
    except grpc.RpcError:
        return None
    return sorted((fact.fact_id, fact.version, fact.text) for fact in listed.facts)


def _call(stub, method: str, request) -> grpc.StatusCode:
    try:
        response = getattr(stub, method)(request, timeout=60)
        if method == "FetchKv":
            list(response)
    except grpc.RpcError as error:
        assert error.code() in CLIENT_ERRORS, f"{method}: {error.code().name}: {error.details()}"
        assert error.details(), f"{method}: {error.code().name} without a message"
        return error.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def bystander_facts(stub) -> list[tuple[str, int, str]]:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=BYSTANDER, facts=[
        pb.FactInput(text="The bystander keeps bees."), pb.FactInput(fact_id="b2", text="The bystander rows.")]))
    facts = _facts_of(stub, BYSTANDER)
    assert facts is not None and len(facts) == 2
    return facts


@pytest.mark.parametrize("method", sorted(REQUESTS))
def test_fuzzed_calls_end_in_a_clear_status_and_a_rejected_one_changes_nothing(method, stub, bystander_facts):
    @settings(max_examples=CASES_PER_RPC, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(request=REQUESTS[method])
    def one_case(request) -> None:
        user_id = getattr(request, "user_id", None)
        before = _facts_of(stub, user_id) if user_id is not None else None
        code = _call(stub, method, request)
        CASES[method] += 1
        OUTCOMES[code.name] += 1
        if code != grpc.StatusCode.OK and before is not None:
            assert _facts_of(stub, user_id) == before, f"{method} was rejected ({code.name}) but changed {user_id!r}"

    one_case()
    assert CASES[method] >= CASES_PER_RPC


def test_after_fuzzing_the_service_serves_and_the_bystander_lost_nothing(memory_service, stub, bystander_facts):
    assert memory_service.process.poll() is None
    with memory_service.channel() as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert _facts_of(stub, BYSTANDER) == bystander_facts
    print(f"\nfuzzed {sum(CASES.values())} calls over {len(CASES)} RPCs; outcomes: {dict(OUTCOMES)}")
