"""The scheduler-side claim: only a provable prefix, and never an exception (it runs inside vLLM's scheduler)."""

import pytest

from inference_node.connector import provable_prefix

PROFILE = "kvp-p"
HEADER = [1, 2, 3]
FACT_A = [10, 11]
FACT_B = [20, 21, 22]
PROMPT = HEADER + FACT_A + FACT_B + [99, 98]


def _plan(*chunks, profile=PROFILE, user="u1"):
    return {"inferscale": {"profile_id": profile, "user_id": user, "chunks": [
        {"fact_id": fact_id, "version": 1, "token_ids": ids} for fact_id, ids in chunks]}}


def test_claims_header_and_every_fact_whose_tokens_match() -> None:
    end, chunks = provable_prefix(PROMPT, _plan(("header", HEADER), ("a", FACT_A), ("b", FACT_B)), PROFILE)
    assert end == len(HEADER + FACT_A + FACT_B)
    assert [(c.fact_id, c.offset) for c in chunks] == [("header", 0), ("a", 3), ("b", 5)]


def test_claim_stops_at_the_first_fact_that_does_not_match() -> None:
    end, chunks = provable_prefix(PROMPT, _plan(("header", HEADER), ("b", FACT_B), ("a", FACT_A)), PROFILE)
    assert end == len(HEADER) and [c.fact_id for c in chunks] == ["header"]


def test_claim_leaves_at_least_one_token_to_compute() -> None:
    end, _ = provable_prefix(HEADER + FACT_A, _plan(("header", HEADER), ("a", FACT_A)), PROFILE)
    assert end == len(HEADER + FACT_A) - 1


def test_another_profile_or_a_missing_header_claims_nothing() -> None:
    assert provable_prefix(PROMPT, _plan(("header", HEADER), profile="kvp-other"), PROFILE) == (0, [])
    assert provable_prefix(PROMPT, _plan(("a", HEADER)), PROFILE) == (0, [])


@pytest.mark.parametrize("params", [
    None, "text", [], {"inferscale": None}, {"inferscale": []}, {"inferscale": {"profile_id": PROFILE}},
    {"inferscale": {"profile_id": PROFILE, "user_id": "u", "chunks": [{"fact_id": "header"}]}},
    {"inferscale": {"profile_id": PROFILE, "user_id": "u", "chunks": [{"token_ids": HEADER, "fact_id": "header",
                                                                       "version": "x"}]}},
    {"inferscale": {"profile_id": PROFILE, "user_id": "u", "chunks": "nope"}},
    {"inferscale": {"profile_id": PROFILE, "user_id": "u", "chunks": [None]}},
])
def test_malformed_plans_claim_nothing_and_never_raise(params) -> None:
    assert provable_prefix(PROMPT, params, PROFILE) == (0, [])
