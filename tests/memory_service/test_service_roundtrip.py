"""Round trips through a real memory service process (real LanceDB, real embedding model)."""

import asyncio
import contextlib
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.router import metric_total, prometheus_samples
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.profile import kv_profile_id
from tests.stacks import Users

user = Users(__name__)
PET_FACTS = [
    pb.FactInput(fact_id="pet", text="Caroline adopted a golden retriever named Max last spring."),
    pb.FactInput(fact_id="job", text="Caroline works as a counselor at a youth center."),
    pb.FactInput(fact_id="food", text="Caroline's favourite dish is her grandmother's lasagna."),
]


def _all_fact_ids(stub, user_id: str) -> list[str]:
    return [fact.fact_id for fact in stub.ListFacts(pb.ListFactsRequest(user_id=user_id, page_size=1000)).facts]


def test_ingested_facts_are_searchable_with_the_relevant_fact_first(stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-search"), facts=PET_FACTS))
    response = stub.SearchFacts(pb.SearchFactsRequest(user_id=user("rt-search"),
                                                      query="What kind of dog does she have?"))
    assert [scored.rank for scored in response.facts] == [1, 2, 3]
    assert response.facts[0].fact.fact_id == "pet"
    assert response.facts[0].score > response.facts[1].score


def test_search_returns_at_most_top_k_facts(stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-topk"), facts=PET_FACTS))
    response = stub.SearchFacts(pb.SearchFactsRequest(user_id=user("rt-topk"), query="dog", top_k=2))
    assert len(response.facts) == 2


def test_search_for_a_user_without_facts_is_empty(stub) -> None:
    assert not stub.SearchFacts(pb.SearchFactsRequest(user_id=user("rt-nobody"), query="anything")).facts


def test_list_facts_pages_through_every_fact_once_in_id_order(stub) -> None:
    facts = [pb.FactInput(fact_id=f"fact-{i:03d}", text=f"Numbered fact {i}") for i in range(25)]
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-pages"), facts=facts))
    seen: list[str] = []
    token = ""
    while True:
        page = stub.ListFacts(pb.ListFactsRequest(user_id=user("rt-pages"), page_size=7, page_token=token))
        assert len(page.facts) <= 7
        seen.extend(fact.fact_id for fact in page.facts)
        token = page.next_page_token
        if not token:
            break
    assert seen == sorted(f"fact-{i:03d}" for i in range(25))


def test_retried_ingest_creates_no_duplicates(stub) -> None:
    request = pb.IngestFactsRequest(
        user_id=user("rt-retry"),
        facts=[pb.FactInput(text="Melanie paints sunsets."), pb.FactInput(text="Melanie runs.")]
    )
    first = stub.IngestFacts(request)
    second = stub.IngestFacts(request)
    assert [f.outcome for f in first.facts] == [pb.INGEST_OUTCOME_CREATED] * 2
    assert [f.outcome for f in second.facts] == [pb.INGEST_OUTCOME_UNCHANGED] * 2
    assert [f.fact_id for f in first.facts] == [f.fact_id for f in second.facts]
    assert stub.GetStats(pb.GetStatsRequest(user_id=user("rt-retry"))).facts == 2


def test_changed_content_bumps_the_version_and_keeps_created_at(stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-version"),
                                           facts=[pb.FactInput(fact_id="city", text="Lives in Oslo")]))
    (before,) = stub.ListFacts(pb.ListFactsRequest(user_id=user("rt-version"))).facts
    response = stub.IngestFacts(
        pb.IngestFactsRequest(user_id=user("rt-version"), facts=[pb.FactInput(fact_id="city", text="Lives in Bergen")])
    )
    assert response.facts[0].outcome == pb.INGEST_OUTCOME_UPDATED
    assert response.facts[0].version == 2
    (after,) = stub.ListFacts(pb.ListFactsRequest(user_id=user("rt-version"))).facts
    assert after.text == "Lives in Bergen" and after.version == 2
    assert after.created_at == before.created_at
    assert after.updated_at.ToMicroseconds() > before.updated_at.ToMicroseconds()


def test_fact_fields_round_trip(stub) -> None:
    fact = pb.FactInput(fact_id="trip", text="Went to Lisbon", source_turn_id="D2:4", metadata={"speaker": "Jon"})
    fact.timestamp.FromJsonString("2023-05-08T13:56:00Z")
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-fields"), facts=[fact]))
    (stored,) = stub.ListFacts(pb.ListFactsRequest(user_id=user("rt-fields"))).facts
    assert (stored.user_id, stored.fact_id, stored.text, stored.source_turn_id) == (
        user("rt-fields"), "trip", "Went to Lisbon", "D2:4"
    )
    assert dict(stored.metadata) == {"speaker": "Jon"}
    assert stored.timestamp.ToJsonString() == "2023-05-08T13:56:00Z"


def test_delete_facts_removes_only_the_named_facts_and_reports_unknown_ids(stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-delete"), facts=PET_FACTS))
    response = stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user("rt-delete"), fact_ids=["pet", "no-such-fact"]))
    assert response.facts_deleted == 1
    assert list(response.not_found_fact_ids) == ["no-such-fact"]
    assert _all_fact_ids(stub, user("rt-delete")) == ["food", "job"]


def test_delete_user_removes_facts_and_turns(stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-gone"), facts=PET_FACTS))
    stub.IngestTurns(pb.IngestTurnsRequest(user_id=user("rt-gone"), turns=[pb.Turn(turn_id="D1:1", seq=1, text="Hi!")]))
    response = stub.DeleteUser(pb.DeleteUserRequest(user_id=user("rt-gone")))
    assert (response.facts_deleted, response.turns_deleted) == (3, 1)
    stats = stub.GetStats(pb.GetStatsRequest(user_id=user("rt-gone")))
    assert (stats.users, stats.facts, stats.turns) == (0, 0, 0)


def _searched(stub, user_id: str) -> list[tuple[str, str, int]]:
    response = stub.SearchFacts(pb.SearchFactsRequest(user_id=user_id, query="Caroline", top_k=10))
    return sorted((scored.fact.fact_id, scored.fact.text, scored.fact.version) for scored in response.facts)


def test_search_sees_every_acknowledged_update_delete_and_new_fact(stub) -> None:
    fresh = user("rt-fresh")
    stub.IngestFacts(pb.IngestFactsRequest(user_id=fresh, facts=PET_FACTS))
    assert len(_searched(stub, fresh)) == 3  # the user's facts are now in the search cache
    stub.IngestFacts(pb.IngestFactsRequest(user_id=fresh, facts=[
        pb.FactInput(fact_id="job", text="Caroline now teaches art."),
        pb.FactInput(fact_id="car", text="Caroline drives a van.")]))
    stub.DeleteFacts(pb.DeleteFactsRequest(user_id=fresh, fact_ids=["food"]))
    assert _searched(stub, fresh) == [("car", "Caroline drives a van.", 1), ("job", "Caroline now teaches art.", 2),
                                     ("pet", PET_FACTS[0].text, 1)]
    stub.DeleteUser(pb.DeleteUserRequest(user_id=fresh))
    assert _searched(stub, fresh) == []


def test_turn_reingest_overwrites_instead_of_duplicating(stub) -> None:
    turns = [pb.Turn(turn_id=f"D1:{i}", seq=i, session_id="S1", speaker="Jon", text=f"turn {i}") for i in range(5)]
    stub.IngestTurns(pb.IngestTurnsRequest(user_id=user("rt-turns"), turns=turns))
    response = stub.IngestTurns(pb.IngestTurnsRequest(user_id=user("rt-turns"), turns=turns))
    assert response.turns_written == 5
    assert stub.GetStats(pb.GetStatsRequest(user_id=user("rt-turns"))).turns == 5


def test_concurrent_ingests_of_the_same_facts_create_no_duplicates(stub) -> None:
    facts = [pb.FactInput(text=f"Concurrent fact number {i}") for i in range(20)]
    request = pb.IngestFactsRequest(user_id=user("rt-concurrent"), facts=facts)
    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(lambda _: stub.IngestFacts(request), range(8)))
    created = sum(f.outcome == pb.INGEST_OUTCOME_CREATED for r in responses for f in r.facts)
    assert created == 20
    assert stub.GetStats(pb.GetStatsRequest(user_id=user("rt-concurrent"))).facts == 20
    assert len(_all_fact_ids(stub, user("rt-concurrent"))) == 20


def _batched_calls(service, code: str) -> float:
    return metric_total(prometheus_samples(f"http://127.0.0.1:{service.metrics_port}/metrics"),
                        "inferscale_batched_calls_total", f'code="{code}"')


def _stage_profile() -> pb.KvProfile:
    profile = pb.KvProfile(model="smollm2-135m", model_hash="m", kv_dtype="float32", tokenizer_hash="t",
                           header_hash="h", recipe="chunked-rope-cwe", recipe_version=1, context_window=0)
    profile.profile_id = kv_profile_id(profile)
    return profile


def test_a_batch_answers_each_call_as_it_would_alone_in_order(memory_service, stub) -> None:
    """RetrieveAndStageBatch: each call's own answer or refusal (naming its field), in the calls' order; a batch of
    no calls or of too many is refused whole."""
    profile = _stage_profile()
    for name in ("rt-batch-a", "rt-batch-b"):
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user(name), facts=[
            pb.FactInput(fact_id="marker", text=f"{name} keeps bees."), *PET_FACTS]))
    calls = [pb.RetrieveAndStageRequest(user_id=user("rt-batch-a"), query="dog", top_k=2, profile=profile,
                                        node_id="n"),
             pb.RetrieveAndStageRequest(user_id="not a valid id", query="dog", top_k=2, profile=profile, node_id="n"),
             pb.RetrieveAndStageRequest(user_id=user("rt-batch-b"), query="bees", top_k=-3, profile=profile,
                                        node_id="n"),
             pb.RetrieveAndStageRequest(user_id=user("rt-batch-b"), query="bees", top_k=3, profile=profile,
                                        node_id="n")]
    refused_before = _batched_calls(memory_service, "INVALID_ARGUMENT")
    results = stub.RetrieveAndStageBatch(pb.RetrieveAndStageBatchRequest(calls=calls)).results
    assert _batched_calls(memory_service, "INVALID_ARGUMENT") == refused_before + 2  # each call counted
    assert [result.code for result in results] == [grpc.StatusCode.OK.value[0], *(
        [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 2), grpc.StatusCode.OK.value[0]]
    assert results[1].message.startswith("user_id:") and results[2].message.startswith("top_k:")
    for call, result in ((calls[0], results[0]), (calls[3], results[3])):
        alone = stub.RetrieveAndStage(call)
        assert [(f.fact_id, f.rank, f.text) for f in result.response.facts] == [
            (f.fact_id, f.rank, f.text) for f in alone.facts]
    assert results[3].response.facts[0].text == "rt-batch-b keeps bees."
    for wrong in ([], calls[:1] * 257):
        with pytest.raises(grpc.RpcError) as error:
            stub.RetrieveAndStageBatch(pb.RetrieveAndStageBatchRequest(calls=wrong))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("calls:")


def test_retrieve_and_stage_returns_ranked_facts_marked_not_ready(stub) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-stage"), facts=PET_FACTS))
    profile = pb.KvProfile(
        model="smollm2-135m", model_hash="m", kv_dtype="float32", tokenizer_hash="t", header_hash="h",
        recipe="chunked-rope-cwe", recipe_version=1, context_window=0,
    )
    profile.profile_id = kv_profile_id(profile)
    response = stub.RetrieveAndStage(
        pb.RetrieveAndStageRequest(user_id=user("rt-stage"), query="dog", top_k=2, profile=profile, node_id="node-0")
    )
    assert [fact.fact_id for fact in response.facts][0] == "pet"
    assert all(not fact.kv_ready and not fact.token_ids for fact in response.facts)
    listed = {f.fact_id: f.created_at for f in stub.ListFacts(pb.ListFactsRequest(user_id=user("rt-stage"))).facts}
    assert all(fact.created_at == listed[fact.fact_id] and fact.created_at.seconds for fact in response.facts)


def test_request_id_is_echoed_in_trailing_metadata(stub) -> None:
    _, call = stub.GetStats.with_call(pb.GetStatsRequest(), metadata=(("x-request-id", "req-123"),))
    assert ("x-request-id", "req-123") in call.trailing_metadata()


def test_metrics_endpoint_counts_calls_by_method_and_code(stub, memory_service) -> None:
    with contextlib.suppress(grpc.RpcError):
        stub.SearchFacts(pb.SearchFactsRequest(user_id="", query="x"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{memory_service.metrics_port}/metrics").read().decode()
    assert 'inferscale_rpc_requests_total{code="INVALID_ARGUMENT",method="SearchFacts"}' in body
    assert "inferscale_facts_stored" in body
    assert "inferscale_rpc_duration_seconds_bucket" in body


def test_a_query_embedded_by_the_caller_with_the_services_model_finds_what_its_text_finds(stub) -> None:
    from inference_node.query_embedding import LocalQueryEmbedder

    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-vector"), facts=PET_FACTS))
    stats = stub.GetStats(pb.GetStatsRequest())
    vector, model_id = asyncio.run(LocalQueryEmbedder(stats.embedding_model).embed("dog"))
    assert model_id == stats.embedding_model_id and model_id.startswith(stats.embedding_model + "@")
    by_text = stub.SearchFacts(pb.SearchFactsRequest(user_id=user("rt-vector"), query="dog", top_k=3,
                                                     retrieval=pb.RETRIEVAL_MODE_VECTOR)).facts
    by_vector = stub.SearchFacts(pb.SearchFactsRequest(user_id=user("rt-vector"), query_vector=vector,
                                                       embedding_model_id=model_id, top_k=3)).facts
    assert [f.fact.fact_id for f in by_vector] == [f.fact.fact_id for f in by_text]
    assert [f.score for f in by_vector] == pytest.approx([f.score for f in by_text], abs=1e-4)


def test_the_rpc_log_line_says_where_an_ingests_and_a_retrieves_time_went(stub, memory_service) -> None:
    """Operators reading a slow call's log line see its steps, each timed from the end of the one before."""
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-steps"), facts=PET_FACTS[:1]),
                     metadata=(("x-request-id", "steps-ingest"),))
    profile = pb.KvProfile(model="m", model_hash="mh", kv_dtype="bfloat16", tokenizer_hash="th", header_hash="hh",
                           recipe="chunked-rope-cwe", recipe_version=1)
    profile.profile_id = kv_profile_id(profile)
    stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=user("rt-steps"), query="pets?", top_k=1, profile=profile,
                                                     node_id="n"), metadata=(("x-request-id", "steps-retrieve"),))
    lines = [json.loads(line) for line in memory_service.log_path.read_text().splitlines() if line.startswith("{")]
    rpc = {line["request_id"]: line for line in lines if line.get("event") == "rpc" and "request_id" in line}
    ingest, retrieve = rpc["steps-ingest"], rpc["steps-retrieve"]
    assert list(ingest["steps_ms"]) == ["admit", "lock", "check", "embed", "write", "kv_queue", "gauges", "rest"]
    assert list(retrieve["steps_ms"]) == ["announce", "embed", "search", "kv_index", "rest"]
    for line in (ingest, retrieve):
        assert all(ms >= 0 for ms in line["steps_ms"].values())
        assert sum(line["steps_ms"].values()) <= line["duration_ms"]


def test_a_call_past_its_deadline_is_logged_and_counted_as_cancelled_not_ok(stub, memory_service) -> None:
    """The handler is cancelled mid-embedding when the client's deadline passes; its log line must not say OK."""
    facts = [pb.FactInput(text=f"fact {n}: " + "the user keeps a long diary of walks, meals and friends " * 6)
             for n in range(200)]
    with pytest.raises(grpc.RpcError) as error:
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user("rt-deadline"), facts=facts), timeout=0.3,
                         metadata=(("x-request-id", "deadline-ingest"),))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):
        lines = [json.loads(line) for line in memory_service.log_path.read_text().splitlines()
                 if line.startswith("{") and '"deadline-ingest"' in line and '"event": "rpc"' in line]
        if lines:
            break
        time.sleep(0.1)
    assert [line["code"] for line in lines] == ["CANCELLED"]
