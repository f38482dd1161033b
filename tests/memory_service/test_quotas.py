"""The per-user fact quota (--max-facts-per-user): a batch that would pass it is RESOURCE_EXHAUSTED and stores
nothing; updates of held facts and other users are unaffected."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from tests.conftest import own_memory_service


@pytest.fixture(scope="module")
def quota_stub(tmp_path_factory) -> Iterator[memory_pb2_grpc.MemoryServiceStub]:
    with own_memory_service(tmp_path_factory, "quota", "--max-facts-per-user", "5") as service, \
            service.channel() as channel:
        yield memory_pb2_grpc.MemoryServiceStub(channel)


def _facts(*ids: str, text: str = "text") -> list[pb.FactInput]:
    return [pb.FactInput(fact_id=fact_id, text=f"{text} {fact_id}") for fact_id in ids]


def _held(stub, user_id: str) -> list[tuple[str, str]]:
    return [(f.fact_id, f.text) for f in stub.ListFacts(pb.ListFactsRequest(user_id=user_id)).facts]


def test_a_batch_past_the_per_user_quota_is_resource_exhausted_and_stores_nothing(quota_stub):
    quota_stub.IngestFacts(pb.IngestFactsRequest(user_id="quota-a", facts=_facts("a", "b", "c", "d")))
    with pytest.raises(grpc.RpcError) as error:
        quota_stub.IngestFacts(pb.IngestFactsRequest(user_id="quota-a", facts=_facts("e", "f")))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 5 per user" in error.value.details()
    assert [fact_id for fact_id, _ in _held(quota_stub, "quota-a")] == ["a", "b", "c", "d"]


def test_updates_of_held_facts_and_other_users_are_not_held_back_by_a_full_user(quota_stub):
    quota_stub.IngestFacts(pb.IngestFactsRequest(user_id="quota-b", facts=_facts("a", "b", "c", "d", "e")))
    quota_stub.IngestFacts(pb.IngestFactsRequest(user_id="quota-b", facts=_facts("a", text="changed")))
    assert ("a", "changed a") in _held(quota_stub, "quota-b")
    quota_stub.IngestFacts(pb.IngestFactsRequest(user_id="quota-c", facts=_facts("a")))
    assert len(_held(quota_stub, "quota-c")) == 1
