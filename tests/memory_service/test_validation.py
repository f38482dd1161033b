import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from inferscale.v1 import memory_pb2 as pb
from memory_service.config import Limits
from memory_service.errors import InvalidArgument, LimitExceeded
from memory_service.validation import (
    decode_page_token,
    derived_fact_id,
    encode_page_token,
    resolve_page_size,
    resolve_top_k,
    validate_facts,
    validate_id,
)

LIMITS = Limits()


def test_fact_without_id_gets_an_id_derived_from_its_text() -> None:
    (fact,) = validate_facts([pb.FactInput(text="Likes tea")], LIMITS)
    assert fact.fact_id == derived_fact_id("Likes tea")
    assert derived_fact_id("Likes tea") != derived_fact_id("Likes coffee")


def test_repeated_fact_id_in_one_batch_names_both_positions() -> None:
    with pytest.raises(InvalidArgument, match=r"facts\[1\]\.fact_id.*facts\[0\]"):
        validate_facts([pb.FactInput(fact_id="a", text="x"), pb.FactInput(fact_id="a", text="y")], LIMITS)


def test_content_hash_ignores_nothing_a_client_can_change() -> None:
    base = pb.FactInput(fact_id="a", text="x", source_turn_id="t1", metadata={"k": "v"})
    variants = [
        pb.FactInput(fact_id="a", text="y", source_turn_id="t1", metadata={"k": "v"}),
        pb.FactInput(fact_id="a", text="x", source_turn_id="t2", metadata={"k": "v"}),
        pb.FactInput(fact_id="a", text="x", source_turn_id="t1", metadata={"k": "w"}),
        pb.FactInput(fact_id="a", text="x", source_turn_id="t1", metadata={"k": "v"}, timestamp=Timestamp(seconds=5)),
    ]
    (reference,) = validate_facts([base], LIMITS)
    for variant in variants:
        (changed,) = validate_facts([variant], LIMITS)
        assert changed.content_hash != reference.content_hash


@pytest.mark.parametrize("bad_id", ["", "has space", "quote'", "a|b", "-leading-dash", "x" * 129, "ünï"])
def test_ids_outside_the_id_alphabet_are_invalid(bad_id: str) -> None:
    with pytest.raises(InvalidArgument, match="user_id"):
        validate_id(bad_id, "user_id")


def test_oversize_text_is_a_limit_not_a_format_error() -> None:
    with pytest.raises(LimitExceeded, match=r"facts\[0\]\.text"):
        validate_facts([pb.FactInput(text="x" * (LIMITS.max_fact_chars + 1))], LIMITS)


def test_top_k_zero_means_default_and_over_max_is_a_limit() -> None:
    assert resolve_top_k(0, LIMITS) == LIMITS.default_top_k
    with pytest.raises(LimitExceeded, match="top_k"):
        resolve_top_k(LIMITS.max_top_k + 1, LIMITS)
    with pytest.raises(InvalidArgument, match="top_k"):
        resolve_top_k(-1, LIMITS)


def test_page_size_is_capped_at_the_maximum() -> None:
    assert resolve_page_size(10**6, LIMITS) == LIMITS.max_page_size


def test_page_token_round_trips_and_garbage_is_rejected() -> None:
    assert decode_page_token(encode_page_token("fact-9")) == "fact-9"
    with pytest.raises(InvalidArgument, match="page_token"):
        decode_page_token("%%%not-base64")
