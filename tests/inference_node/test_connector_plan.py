"""The scheduler-side claim: only what a signed plan proves against the prompt, and never an exception (it runs
inside vLLM's scheduler)."""

from types import SimpleNamespace

import pytest

from inference_node.plan import PlanSigner, build_plan, provable_prefix, strip_client_plans
from inferscale_kv.kv_key import content_id

PROFILE = "kvp-p"
HEADER = [1, 2, 3]
FACT_A = [10, 11]
FACT_B = [20, 21, 22]
PROMPT = HEADER + FACT_A + FACT_B + [99, 98]
SIGNER = PlanSigner(b"k" * 32)


def _plan(*facts, profile=PROFILE, user="u1", header=HEADER):
    return build_plan(profile, user, content_id(profile, [], header), header,
                      [(fact_id, 1, content_id(profile, header, ids), ids) for fact_id, ids in facts])


def test_claims_header_and_every_fact_whose_tokens_match() -> None:
    end, chunks = provable_prefix(PROMPT, _plan(("a", FACT_A), ("b", FACT_B)), PROFILE)
    assert end == len(HEADER + FACT_A + FACT_B)
    assert [(c.key.fact_id, c.offset, c.key.is_header) for c in chunks] == [
        ("header", 0, True), ("a", 3, False), ("b", 5, False)]


def test_a_fact_named_like_the_header_is_keyed_as_that_users_fact() -> None:
    """Regression: a fact whose id was "header" was given the header's KV."""
    end, chunks = provable_prefix(PROMPT, _plan(("header", FACT_A)), PROFILE)
    assert end == len(HEADER + FACT_A)
    assert chunks[1].key.user_id == "u1" and not chunks[1].key.is_header and chunks[1].key != chunks[0].key


def test_claim_stops_at_the_first_fact_that_does_not_match() -> None:
    end, chunks = provable_prefix(PROMPT, _plan(("b", FACT_B), ("a", FACT_A)), PROFILE)
    assert end == len(HEADER) and [c.key.fact_id for c in chunks] == ["header"]


def test_claim_leaves_at_least_one_token_to_compute() -> None:
    end, _ = provable_prefix(HEADER + FACT_A, _plan(("a", FACT_A)), PROFILE)
    assert end == len(HEADER + FACT_A) - 1


def test_another_profile_or_a_header_that_does_not_match_claims_nothing() -> None:
    assert provable_prefix(PROMPT, _plan(profile="kvp-other"), PROFILE) == (0, [])
    assert provable_prefix(PROMPT, _plan(("a", FACT_A), header=[7, 7]), PROFILE) == (0, [])


@pytest.mark.parametrize("plan", [
    {}, {"v": 1}, {"v": 2, **_plan()}, {**_plan(), "user_id": ""}, {**_plan(), "user_id": "_profile"},
    {**_plan(), "header": None}, {**_plan(), "facts": "nope"}, {**_plan(), "facts": [None]},
    {**_plan(), "header": {"content_id": "not-hex", "token_ids": HEADER}},
    {**_plan(), "header": {"content_id": "a" * 32, "token_ids": "123"}},
])
def test_malformed_plans_claim_nothing_and_never_raise(plan) -> None:
    end, chunks = provable_prefix(PROMPT, plan, PROFILE)
    assert end == 0 or [c.key.fact_id for c in chunks] == ["header"]


def test_only_the_signers_own_plans_verify() -> None:
    plan = _plan(("a", FACT_A))
    params = SIGNER.kv_transfer_params(plan)
    assert SIGNER.verified(params) == plan
    altered = {"inferscale": {**params["inferscale"], "plan": {**plan, "user_id": "victim"}}}
    assert SIGNER.verified(altered) is None
    assert PlanSigner(b"o" * 32).verified(params) is None
    unsigned = {"inferscale": {"plan": plan}}
    for bad in (None, "x", [], {"inferscale": None}, unsigned, {"inferscale": {"plan": plan, "sig": 5}}):
        assert SIGNER.verified(bad) is None


def test_the_cache_salt_is_bound_to_the_plan_and_the_secret() -> None:
    plan = _plan(("a", FACT_A))
    salt = SIGNER.cache_salt(plan)
    assert salt.startswith("isk-") and salt == SIGNER.cache_salt(_plan(("a", FACT_A)))
    assert salt != SIGNER.cache_salt(_plan(("b", FACT_B)))
    assert salt != PlanSigner(b"o" * 32).cache_salt(plan)


def test_client_plans_and_reserved_salts_are_stripped_at_any_depth() -> None:
    body = {"kv_transfer_params": {"x": 1}, "cache_salt": "isk-forged", "vllm_xargs": {"kv_transfer_params": {}},
            "requests": [{"kv_transfer_params": None, "cache_salt": "mine"}]}
    assert strip_client_plans(body) == 4
    assert body == {"vllm_xargs": {}, "requests": [{"cache_salt": "mine"}]}
    assert strip_client_plans([1, "a", None]) == 0


