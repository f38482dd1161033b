"""Requests whose bytes are not a valid message, through a real memory service and a generic channel call (what any
client library can send): every RPC answers INVALID_ARGUMENT naming where the bytes break, and nothing is written.

Regression: a fact text that is not valid UTF-8 (protobuf refuses the whole message for it) was answered UNKNOWN, the
deserializer's exception escaping to gRPC."""

from __future__ import annotations

import grpc
import pytest

from inferscale.v1 import memory_pb2 as pb
from tests.stacks import Users

user = Users(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["MemoryService"]

USER = user("unparsable-user")
TEXT = "Maya keeps a kayak under the porch."
NOT_UTF8 = b"\xff\xfe\xc3("  # no UTF-8 decoder accepts it


def _raw_call(channel: grpc.Channel, method: str, body: bytes) -> grpc.RpcError:
    """Sends `body` as the request of `method` without serializing anything; returns the error it ends in."""
    descriptor = SERVICE.methods_by_name[method]
    path = f"/{SERVICE.full_name}/{method}"
    call = (channel.unary_stream(path) if descriptor.server_streaming else channel.unary_unary(path))
    with pytest.raises(grpc.RpcError) as raised:
        response = call(body, timeout=30)
        if descriptor.server_streaming:
            list(response)
    return raised.value


def _state(stub) -> tuple:
    listed = stub.ListFacts(pb.ListFactsRequest(user_id=USER, page_size=1000))
    stats = stub.GetStats(pb.GetStatsRequest())
    return sorted((fact.fact_id, fact.version, fact.text) for fact in listed.facts), stats.facts, stats.users, \
        len(stats.profiles)


def test_a_fact_text_that_is_not_utf8_is_invalid_argument_naming_the_field_and_nothing_is_stored(memory_service,
                                                                                                  stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[pb.FactInput(fact_id="kayak", text=TEXT)]))
    before = _state(stub)
    body = pb.IngestFactsRequest(user_id=USER, facts=[
        pb.FactInput(fact_id="kayak", text="CHANGED"), pb.FactInput(fact_id="new", text="PLACEHOLDER")],
    ).SerializeToString().replace(b"PLACEHOLDER", NOT_UTF8 + b"ABCDEFG")
    with memory_service.channel() as channel:
        error = _raw_call(channel, "IngestFacts", body)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert error.details().startswith("facts[1].text: not valid UTF-8"), error.details()
    assert "inferscale.v1.IngestFactsRequest" in error.details()
    assert _state(stub) == before


# A string field of each RPC's request, made invalid UTF-8 (the first field the walk of the bytes meets).
BAD_STRING = {
    "IngestTurns": (pb.IngestTurnsRequest(user_id=USER, turns=[pb.Turn(turn_id="t1", text="PLACEHOLDER")]),
                    "turns[0].text"),
    "IngestFacts": (pb.IngestFactsRequest(user_id="PLACEHOLDER"), "user_id"),
    "SearchFacts": (pb.SearchFactsRequest(user_id=USER, query="PLACEHOLDER"), "query"),
    "RetrieveAndStage": (pb.RetrieveAndStageRequest(user_id=USER, profile=pb.KvProfile(model="PLACEHOLDER")),
                         "profile.model"),
    "RetrieveAndStageBatch": (pb.RetrieveAndStageBatchRequest(calls=[
        pb.RetrieveAndStageRequest(user_id=USER), pb.RetrieveAndStageRequest(user_id="PLACEHOLDER")]),
        "calls[1].user_id"),
    "ListFacts": (pb.ListFactsRequest(user_id=USER, page_token="PLACEHOLDER"), "page_token"),
    "DeleteFacts": (pb.DeleteFactsRequest(user_id=USER, fact_ids=["kayak", "PLACEHOLDER"]), "fact_ids[1]"),
    "DeleteUser": (pb.DeleteUserRequest(user_id="PLACEHOLDER"), "user_id"),
    "GetStats": (pb.GetStatsRequest(user_id="PLACEHOLDER"), "user_id"),
    "AnnounceProfile": (pb.AnnounceProfileRequest(announcer_id="PLACEHOLDER"), "announcer_id"),
    "LeaseKvWork": (pb.LeaseKvWorkRequest(worker_id="w", profile_id="PLACEHOLDER"), "profile_id"),
    "CompleteKvWork": (pb.CompleteKvWorkRequest(failures=[pb.FactKvFailure(error="PLACEHOLDER")]),
                       "failures[0].error"),
    "FetchKv": (pb.FetchKvRequest(user_id=USER, facts=[pb.FactRef(fact_id="PLACEHOLDER")]), "facts[0].fact_id"),
}


def test_every_rpc_covered() -> None:
    assert set(BAD_STRING) == set(SERVICE.methods_by_name)


@pytest.mark.parametrize("method", sorted(BAD_STRING))
def test_every_rpc_answers_a_request_that_does_not_parse_with_invalid_argument(memory_service, stub, method) -> None:
    before = _state(stub)
    message, field = BAD_STRING[method]
    body = message.SerializeToString().replace(b"PLACEHOLDER", NOT_UTF8 + b"ABCDEFG")
    with memory_service.channel() as channel:
        bad_string = _raw_call(channel, method, body)
        truncated = _raw_call(channel, method, b"\x0a\x7f" + b"x" * 3)  # field 1 says 127 bytes follow; 3 do
    assert bad_string.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad_string.code(), bad_string.details())
    assert bad_string.details().startswith(f"{field}: not valid UTF-8"), bad_string.details()
    assert truncated.code() == grpc.StatusCode.INVALID_ARGUMENT, (truncated.code(), truncated.details())
    assert "malformed protobuf" in truncated.details()
    assert _state(stub) == before
