"""Every RPC's bad inputs end in the right status, name the field, and change nothing stored."""

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.profile import kv_profile_id
from memory_service.config import Limits
from tests.stacks import Users

user = Users(__name__)
OWNER = user("bi-owner")
LIMITS = Limits()
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
NOT_FOUND = grpc.StatusCode.NOT_FOUND


def _profile(**overrides) -> pb.KvProfile:
    profile = pb.KvProfile(
        model="m", model_hash="mh", kv_dtype="float32", tokenizer_hash="th", header_hash="hh",
        recipe="chunked-rope-cwe", recipe_version=1, **overrides,
    )
    profile.profile_id = kv_profile_id(profile)
    return profile


def _valid_then(bad: pb.FactInput) -> list[pb.FactInput]:
    """A batch whose first entry would change the owner's stored fact, followed by a bad one."""
    return [pb.FactInput(fact_id="pet", text="CHANGED by a rejected call"), bad]


CASES = [
    ("IngestFacts", pb.IngestFactsRequest(user_id="", facts=[pb.FactInput(text="x")]), INVALID, "user_id"),
    ("IngestFacts", pb.IngestFactsRequest(user_id="has space", facts=[pb.FactInput(text="x")]), INVALID, "user_id"),
    ("IngestFacts", pb.IngestFactsRequest(user_id="x' OR '1'='1", facts=[pb.FactInput(text="x")]), INVALID, "user_id"),
    ("IngestFacts", pb.IngestFactsRequest(user_id=OWNER), INVALID, "facts"),
    ("IngestFacts", pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(text=""))), INVALID,
     "facts[1].text"),
    ("IngestFacts", pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(text=" \n\t"))), INVALID,
     "facts[1].text"),
    ("IngestFacts", pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(text="a\x00b"))), INVALID,
     "facts[1].text"),
    ("IngestFacts",
     pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(text="x" * (LIMITS.max_fact_chars + 1)))),
     EXHAUSTED, "facts[1].text"),
    ("IngestFacts",
     pb.IngestFactsRequest(user_id=OWNER,
                           facts=[pb.FactInput(text=f"f{i}") for i in range(LIMITS.max_facts_per_call + 1)]),
     EXHAUSTED, "facts"),
    ("IngestFacts", pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(fact_id="a b", text="x"))),
     INVALID, "facts[1].fact_id"),
    ("IngestFacts", pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(fact_id="pet", text="x"))),
     INVALID, "facts[1].fact_id"),
    ("IngestFacts",
     pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(text="x", source_turn_id="D1 3"))),
     INVALID, "facts[1].source_turn_id"),
    ("IngestFacts",
     pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(pb.FactInput(text="x", timestamp=Timestamp(seconds=-5)))),
     INVALID, "facts[1].timestamp"),
    ("IngestFacts",  # past protobuf's Timestamp range (year 9999): ranking by date could not read it
     pb.IngestFactsRequest(user_id=OWNER,
                           facts=_valid_then(pb.FactInput(text="x", timestamp=Timestamp(seconds=10**12)))),
     INVALID, "facts[1].timestamp"),
    ("IngestFacts",
     pb.IngestFactsRequest(user_id=OWNER, facts=_valid_then(
         pb.FactInput(text="x", metadata={f"k{i}": "v" for i in range(LIMITS.max_metadata_entries + 1)}))),
     EXHAUSTED, "facts[1].metadata"),
    ("IngestTurns", pb.IngestTurnsRequest(user_id=OWNER), INVALID, "turns"),
    ("IngestTurns", pb.IngestTurnsRequest(user_id=OWNER, turns=[pb.Turn(turn_id="", seq=1, text="x")]), INVALID,
     "turns[0].turn_id"),
    ("IngestTurns", pb.IngestTurnsRequest(user_id=OWNER, turns=[pb.Turn(turn_id="t", seq=-1, text="x")]), INVALID,
     "turns[0].seq"),
    ("IngestTurns", pb.IngestTurnsRequest(user_id=OWNER, turns=[pb.Turn(turn_id="t", seq=1, text="")]), INVALID,
     "turns[0].text"),
    ("SearchFacts", pb.SearchFactsRequest(user_id="", query="x"), INVALID, "user_id"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query=""), INVALID, "query"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query="q" * (LIMITS.max_query_chars + 1)), EXHAUSTED,
     "query"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query="x", top_k=-1), INVALID, "top_k"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query_vector=[1.0] * 384, embedding_model_id="other@1"),
     INVALID, "embedding_model_id"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query_vector=[1.0] * 384), INVALID, "embedding_model_id"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query="x", top_k=2**31 - 1), EXHAUSTED, "top_k"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query="x", retrieval=99), INVALID, "retrieval"),
    ("SearchFacts", pb.SearchFactsRequest(user_id=OWNER, query=" ", retrieval=pb.RETRIEVAL_MODE_KEYWORD), INVALID,
     "query"),
    ("RetrieveAndStage", pb.RetrieveAndStageRequest(user_id=OWNER, query="x", node_id="n", retrieval=-1,
                                                    profile=_profile()), INVALID, "retrieval"),
    ("RetrieveAndStage", pb.RetrieveAndStageRequest(user_id=OWNER, query="x", node_id="n"), INVALID,
     "profile.model"),
    ("RetrieveAndStage",
     pb.RetrieveAndStageRequest(user_id=OWNER, query="x", node_id="n", profile=pb.KvProfile(
         model="m", model_hash="mh", kv_dtype="float32", tokenizer_hash="th", header_hash="hh", recipe="r",
         recipe_version=1, profile_id="kvp-stale")),
     INVALID, "profile.profile_id"),
    ("RetrieveAndStage", pb.RetrieveAndStageRequest(user_id=OWNER, query="x", profile=_profile()), INVALID,
     "node_id"),
    ("RetrieveAndStage", pb.RetrieveAndStageRequest(user_id=OWNER, query="x", node_id="n", top_k=-3,
                                                    profile=_profile()), INVALID, "top_k"),
    ("ListFacts", pb.ListFactsRequest(user_id=OWNER, page_size=-1), INVALID, "page_size"),
    ("ListFacts", pb.ListFactsRequest(user_id=OWNER, page_token="not a token"), INVALID, "page_token"),
    ("DeleteFacts", pb.DeleteFactsRequest(user_id=user("bi-unknown-user"), fact_ids=["pet"]), NOT_FOUND, "user_id"),
    ("DeleteFacts", pb.DeleteFactsRequest(user_id=OWNER), INVALID, "fact_ids"),
    ("DeleteFacts", pb.DeleteFactsRequest(user_id=OWNER, fact_ids=["pet", "bad id"]), INVALID, "fact_ids[1]"),
    ("DeleteUser", pb.DeleteUserRequest(user_id=""), INVALID, "user_id"),
    ("DeleteUser", pb.DeleteUserRequest(user_id=user("bi-unknown-user")), NOT_FOUND, "user_id"),
    ("GetStats", pb.GetStatsRequest(user_id="bad id"), INVALID, "user_id"),
]


@pytest.fixture(scope="module")
def seeded(stub):
    stub.IngestFacts(pb.IngestFactsRequest(user_id=OWNER, facts=[
        pb.FactInput(fact_id="pet", text="Owns a cat called Miso"),
        pb.FactInput(fact_id="home", text="Lives near the harbour"),
    ]))
    stub.IngestTurns(pb.IngestTurnsRequest(user_id=OWNER, turns=[pb.Turn(turn_id="D1:1", seq=1, text="hello")]))
    return stub


def _snapshot(stub):
    """The owner's facts and the whole service's figures, less those that change with the clock alone."""
    facts = stub.ListFacts(pb.ListFactsRequest(user_id=OWNER, page_size=1000)).facts
    stats = stub.GetStats(pb.GetStatsRequest())
    for profile in stats.profiles:
        profile.ClearField("lag_seconds")
    for worker in stats.workers:
        worker.ClearField("last_seen_seconds_ago")
    return [fact.SerializeToString(deterministic=True) for fact in facts], stats


@pytest.mark.parametrize(
    ("method", "request_message", "code", "field"), CASES, ids=[f"{c[0]}-{i}-{c[3]}" for i, c in enumerate(CASES)]
)
def test_bad_request_gets_the_right_status_names_the_field_and_changes_nothing(
    seeded, method, request_message, code, field
) -> None:
    before = _snapshot(seeded)
    with pytest.raises(grpc.RpcError) as raised:
        getattr(seeded, method)(request_message)
    assert raised.value.code() == code, raised.value.details()
    assert raised.value.details().startswith(field), raised.value.details()
    assert _snapshot(seeded) == before


def test_service_still_answers_after_every_bad_request(seeded) -> None:
    response = seeded.SearchFacts(pb.SearchFactsRequest(user_id=OWNER, query="cat"))
    assert response.facts[0].fact.fact_id == "pet"


def _service_model_id(stub) -> str:
    return stub.GetStats(pb.GetStatsRequest()).embedding_model_id


@pytest.mark.parametrize(("vector", "field"), [([1.0] * 383, "query_vector"), ([0.0] * 384, "query_vector"),
                                                ([float("nan")] * 384, "query_vector")])
def test_a_callers_query_vector_of_the_services_model_but_not_a_usable_vector_is_invalid(stub, vector, field):
    with pytest.raises(grpc.RpcError) as error:
        stub.SearchFacts(pb.SearchFactsRequest(user_id=OWNER, query_vector=vector,
                                               embedding_model_id=_service_model_id(stub)))
    assert error.value.code() == INVALID and field in error.value.details()
