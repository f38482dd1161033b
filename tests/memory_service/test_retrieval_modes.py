"""Retrieval modes through a real memory service (real LanceDB, per-user BM25, the real embedding model):
vector, keyword and hybrid; a keyword-only fact, deletes, ties and the requests each mode refuses."""

from __future__ import annotations

import grpc
import pytest

from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.profile import kv_profile_id
from tests.stacks import Users

user = Users(__name__)
MODES = {"vector": pb.RETRIEVAL_MODE_VECTOR, "keyword": pb.RETRIEVAL_MODE_KEYWORD, "hybrid": pb.RETRIEVAL_MODE_HYBRID}
DOG_FACTS = [
    "Caroline's dog Max loves the beach.", "Caroline walks her dog every morning.",
    "Caroline's dog is a golden retriever.", "Caroline bought her dog a new red collar.",
    "Caroline's dog sleeps on the sofa.", "Caroline takes her dog to the vet each spring.",
]
PARCEL = pb.FactInput(fact_id="parcel", text="Parcel QJ-7731 shipped on Tuesday.")
PARCEL_QUESTION = "What did Caroline say about her dog and parcel QJ-7731?"


def _profile() -> pb.KvProfile:
    profile = pb.KvProfile(model="m", model_hash="mh", kv_dtype="float32", tokenizer_hash="th", header_hash="hh",
                           recipe="chunked-rope-cwe", recipe_version=1)
    profile.profile_id = kv_profile_id(profile)
    return profile


def _ingest(stub, user_id: str, *facts: pb.FactInput) -> None:
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        *(pb.FactInput(fact_id=f"dog{i}", text=text) for i, text in enumerate(DOG_FACTS)), *facts]))


def _ranked(stub, user_id: str, query: str, mode: str, top_k: int = 100) -> list[str]:
    response = stub.SearchFacts(pb.SearchFactsRequest(user_id=user_id, query=query, top_k=top_k,
                                                      retrieval=MODES[mode]))
    assert [scored.rank for scored in response.facts] == list(range(1, len(response.facts) + 1))
    return [scored.fact.fact_id for scored in response.facts]


def test_a_fact_only_its_keywords_find_is_keywords_first_and_fused_above_its_vector_rank(stub) -> None:
    _ingest(stub, user("modes-parcel"), PARCEL)  # searched right after IngestFacts returns (unindexed rows included)
    by_vector = _ranked(stub, user("modes-parcel"), PARCEL_QUESTION, "vector")
    assert "parcel" not in by_vector[:3]
    assert _ranked(stub, user("modes-parcel"), PARCEL_QUESTION, "keyword", top_k=3)[0] == "parcel"
    by_hybrid = _ranked(stub, user("modes-parcel"), PARCEL_QUESTION, "hybrid")
    assert by_hybrid.index("parcel") < by_vector.index("parcel")
    assert sorted(by_hybrid) == sorted(by_vector)  # hybrid ranks every fact a vector search ranks


def test_keyword_search_returns_only_facts_sharing_a_word_with_the_query(stub) -> None:
    _ingest(stub, user("modes-words"), PARCEL)
    assert _ranked(stub, user("modes-words"), "QJ-7731", "keyword") == ["parcel"]
    assert _ranked(stub, user("modes-words"), "the of and", "keyword") == []  # stop words only


def test_a_deleted_fact_is_returned_by_no_mode(stub) -> None:
    _ingest(stub, user("modes-deleted"), PARCEL)
    for mode in MODES:
        assert "parcel" in _ranked(stub, user("modes-deleted"), PARCEL_QUESTION, mode)
    stub.DeleteFacts(pb.DeleteFactsRequest(user_id=user("modes-deleted"), fact_ids=["parcel"]))
    for mode in MODES:
        ranked = _ranked(stub, user("modes-deleted"), PARCEL_QUESTION, mode)
        assert "parcel" not in ranked and ranked  # the dog facts are still found


def test_no_mode_returns_another_users_facts(stub) -> None:
    _ingest(stub, user("modes-owner"), PARCEL)
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("modes-other"), facts=[
        pb.FactInput(fact_id="mine", text="Ben keeps bees.")]))
    for mode in MODES:
        assert _ranked(stub, user("modes-other"), PARCEL_QUESTION + " bees", mode) in ([], ["mine"])


def test_equal_facts_are_ranked_by_fact_id_in_every_mode(stub) -> None:
    for fact_id in ("c", "a", "b"):  # one per call: the embedding of a text is the same only in the same batch place
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user("modes-ties"), facts=[
            pb.FactInput(fact_id=fact_id, text="Ana grows tomatoes on her balcony.")]))
    for mode in MODES:
        assert _ranked(stub, user("modes-ties"), "tomatoes on the balcony", mode) == ["a", "b", "c"]


def test_hybrid_ranks_facts_of_the_month_a_question_names_first(stub) -> None:
    june = pb.FactInput(fact_id="june", text="Ana went hiking.")
    may = pb.FactInput(fact_id="may", text="Ana went hiking.")
    june.timestamp.FromJsonString("2023-06-10T12:00:00Z")
    may.timestamp.FromJsonString("2023-05-10T12:00:00Z")
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user("modes-dates"), facts=[june, may]))
    assert _ranked(stub, user("modes-dates"), "Where did Ana go hiking in June 2023?", "hybrid") == ["june", "may"]
    assert _ranked(stub, user("modes-dates"), "Where did Ana go hiking in May?", "hybrid") == ["may", "june"]


def test_retrieve_and_stage_ranks_as_search_facts_in_every_mode(stub) -> None:
    _ingest(stub, user("modes-stage"), PARCEL)
    for mode, value in MODES.items():
        staged = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
            user_id=user("modes-stage"), query=PARCEL_QUESTION, top_k=5, profile=_profile(), node_id="n",
            retrieval=value))
        assert [fact.fact_id for fact in staged.facts] == _ranked(stub, user("modes-stage"), PARCEL_QUESTION, mode, 5)


def test_a_query_vector_alone_is_ranked_by_vector_unless_a_mode_needing_text_is_asked(stub) -> None:
    _ingest(stub, user("modes-vector"), PARCEL)
    model_id = stub.GetStats(pb.GetStatsRequest()).embedding_model_id
    vector = [1.0] + [0.0] * 383
    alone = stub.SearchFacts(pb.SearchFactsRequest(user_id=user("modes-vector"), query_vector=vector,
                                                   embedding_model_id=model_id, top_k=3))
    assert len(alone.facts) == 3
    for mode in ("keyword", "hybrid"):
        with pytest.raises(grpc.RpcError) as refused:
            stub.SearchFacts(pb.SearchFactsRequest(user_id=user("modes-vector"), query_vector=vector,
                                                   embedding_model_id=model_id, retrieval=MODES[mode]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("query:")
    both = stub.SearchFacts(pb.SearchFactsRequest(user_id=user("modes-vector"), query="QJ-7731", query_vector=vector,
                                                  embedding_model_id=model_id, retrieval=MODES["keyword"]))
    assert [scored.fact.fact_id for scored in both.facts] == ["parcel"]
