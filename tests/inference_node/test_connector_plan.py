"""The scheduler-side claim: only what a signed plan proves against the prompt, and never an exception (it runs
inside vLLM's scheduler)."""

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inference_node.plan import (
    NO_PREFIX,
    LoadPlan,
    PlanFact,
    PlanHeader,
    PlanSigner,
    ProvenPrefix,
    _canonical,
    provable_prefix,
    strip_client_plans,
)
from inferscale_kv.kv_key import content_id

PROFILE = "kvp-p"
HEADER = [1, 2, 3]
FACT_A = [10, 11]
FACT_B = [20, 21, 22]
PROMPT = HEADER + FACT_A + FACT_B + [99, 98]
SIGNER = PlanSigner(b"k" * 32)


def _plan(*facts, profile=PROFILE, user="u1", header=HEADER) -> LoadPlan:
    return LoadPlan(profile, user, PlanHeader(content_id(profile, [], header), tuple(header)),
                    tuple(PlanFact(fact_id, 1, content_id(profile, header, ids), tuple(ids)) for fact_id, ids in facts))


def _prove(wire: object) -> ProvenPrefix:
    """What the scheduler makes of a wire plan (its signature checked): parsed, then proved."""
    plan = LoadPlan.from_wire(wire)
    return NO_PREFIX if plan is None else provable_prefix(PROMPT, plan, PROFILE)


def test_claims_header_and_every_fact_whose_tokens_match() -> None:
    proof = provable_prefix(PROMPT, _plan(("a", FACT_A), ("b", FACT_B)), PROFILE)
    assert proof.end == len(HEADER + FACT_A + FACT_B) and proof.user_id == "u1"
    assert [(c.key.fact_id, c.offset, c.key.is_header) for c in proof.chunks] == [
        ("header", 0, True), ("a", 3, False), ("b", 5, False)]


def test_a_fact_named_like_the_header_is_keyed_as_that_users_fact() -> None:
    """Regression: a fact whose id was "header" was given the header's KV."""
    proof = provable_prefix(PROMPT, _plan(("header", FACT_A)), PROFILE)
    chunks = proof.chunks
    assert proof.end == len(HEADER + FACT_A)
    assert chunks[1].key.user_id == "u1" and not chunks[1].key.is_header and chunks[1].key != chunks[0].key


def test_claim_stops_at_the_first_fact_that_does_not_match() -> None:
    proof = provable_prefix(PROMPT, _plan(("b", FACT_B), ("a", FACT_A)), PROFILE)
    assert proof.end == len(HEADER) and [c.key.fact_id for c in proof.chunks] == ["header"]


def test_claim_leaves_at_least_one_token_to_compute() -> None:
    assert provable_prefix(HEADER + FACT_A, _plan(("a", FACT_A)), PROFILE).end == len(HEADER + FACT_A) - 1


def test_another_profile_or_a_header_that_does_not_match_claims_nothing() -> None:
    assert provable_prefix(PROMPT, _plan(profile="kvp-other"), PROFILE) == NO_PREFIX
    assert provable_prefix(PROMPT, _plan(("a", FACT_A), header=[7, 7]), PROFILE) == NO_PREFIX


def test_the_proof_names_the_chunks_a_load_from_a_position_needs() -> None:
    proof = provable_prefix(PROMPT, _plan(("a", FACT_A), ("b", FACT_B)), PROFILE)
    assert [c.key.fact_id for c in proof.chunks_from(4)] == ["a", "b"]  # position 4 is inside fact a
    assert [c.key.fact_id for c in proof.chunks_from(5)] == ["b"]


@pytest.mark.parametrize("plan", [
    {}, {"v": 1}, {**_plan().to_wire(), "v": 2}, {**_plan().to_wire(), "user_id": ""},
    {**_plan().to_wire(), "user_id": "_profile"}, {**_plan().to_wire(), "header": None},
    {**_plan().to_wire(), "facts": "nope"}, {**_plan().to_wire(), "facts": [None]},
    {**_plan().to_wire(), "header": {"content_id": "not-hex", "token_ids": HEADER}},
    {**_plan().to_wire(), "header": {"content_id": "a" * 32, "token_ids": "123"}},
])
def test_malformed_plans_claim_nothing_and_never_raise(plan) -> None:
    proof = _prove(plan)
    assert proof.end == 0 or [c.key.fact_id for c in proof.chunks] == ["header"]


@pytest.mark.parametrize("signed", [
    {"plan": {**_plan().to_wire(), "user_id": "\ud800"}, "sig": "0" * 64},  # a lone surrogate JSON can carry
    {"plan": _plan().to_wire(), "sig": "\udfff"},
])
def test_a_plan_with_a_string_utf8_cannot_encode_is_refused_without_raising(signed) -> None:
    """The check runs on vLLM's scheduling thread: an exception there would stop the engine for every user."""
    assert SIGNER.verified_with_salt({"inferscale": signed}) is None


def test_the_wire_form_and_its_signature_are_the_ones_plans_were_signed_with_before_the_plan_was_typed() -> None:
    """A plan the node signed before `LoadPlan` existed still verifies, with the same salt (rolling upgrades)."""
    plan = LoadPlan("kvp-p", "u1", PlanHeader("a" * 32, (1, 2, 3)),
                    (PlanFact("a", 1, "b" * 32, (10, 11)), PlanFact("b", 2, "c" * 32, (20, 21, 22))))
    signed_before = json.loads(
        '{"inferscale": {"plan": {"v": 1, "profile_id": "kvp-p", "user_id": "u1", "header": {"content_id": '
        '"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "token_ids": [1, 2, 3]}, "facts": [{"fact_id": "a", "version": 1, '
        '"content_id": "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "token_ids": [10, 11]}, {"fact_id": "b", "version": 2, '
        '"content_id": "cccccccccccccccccccccccccccccccc", "token_ids": [20, 21, 22]}]}, '
        '"sig": "8059bbfa4ab9025be83c25a504e496eae2ab464fa35f425702903cdf70e2db69"}}')
    assert SIGNER.kv_transfer_params(plan) == signed_before
    assert SIGNER.verified(signed_before) == plan
    assert SIGNER.cache_salt(plan) == "isk-3339242c3b85e17d7ff095a45cfd69e3"
    assert SIGNER.user_salt("kvp-p", "u1") == "isk-dd3fb5872c0380d3a6b046e3654bd69d"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=10)
# Equal to a valid value in Python, not in JSON:
look_alikes: st.SearchStrategy[object] = st.sampled_from([True, False, 1.0, 1, "1", None, [], {}])
token_ids = st.lists(st.integers(-3, 200), max_size=4).map(tuple)
plans = st.builds(LoadPlan, st.text(max_size=5), st.text(max_size=5),
                  st.builds(PlanHeader, st.text(max_size=5), token_ids),
                  st.lists(st.builds(PlanFact, st.text(max_size=5), st.integers(), st.text(max_size=5), token_ids),
                           max_size=3).map(tuple))


def _places(node: object, path: tuple = ()) -> list[tuple]:
    """Every place in a wire value: the path of keys and indices to each dict or list entry."""
    entries = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    return [place for key, child in entries for place in [(*path, key), *_places(child, (*path, key))]]


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(plan=plans, data=st.data())
def test_any_wire_value_is_refused_or_parsed_to_a_plan_whose_wire_form_is_the_same_bytes(plan, data) -> None:
    """from_wire never raises on a plan's wire form with any one part replaced, removed or added, and what it
    accepts signs and salts exactly as what was sent."""
    wire = json.loads(json.dumps(plan.to_wire()))
    assert LoadPlan.from_wire(wire) == plan
    *parents, last = data.draw(st.sampled_from(_places(wire)))
    parent = wire
    for step in parents:
        parent = parent[step]
    change = data.draw(st.sampled_from(["replace", "remove", "add"]))
    if change == "replace":
        parent[last] = data.draw(look_alikes | json_values)
    elif change == "remove":
        del parent[last]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=10))] = data.draw(json_values)
    else:
        parent.append(data.draw(json_values))
    spoiled = LoadPlan.from_wire(wire)
    if spoiled is not None:
        assert json.dumps(spoiled.to_wire(), sort_keys=True) == json.dumps(wire, sort_keys=True)
        assert SIGNER.verified({"inferscale": {"plan": wire, "sig": SIGNER.kv_transfer_params(spoiled)["inferscale"]
                                               ["sig"]}}) == spoiled
        provable_prefix(PROMPT, spoiled, PROFILE)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(plan=plans)
@example(plan=LoadPlan("p\x7f", "u\n\x00\"\\", PlanHeader("", (2**70, -1)), ()))  # json escapes each
@example(plan=LoadPlan("p", "\u00fc", PlanHeader("", ()), ()))
def test_the_canonical_form_is_jsons_sorted_compact_dump_of_any_plan(plan) -> None:
    """Signatures and salts are HMACs of these bytes: the fast encoder must write json's, escapes included."""
    assert _canonical(plan.to_wire()) == json.dumps(plan.to_wire(), sort_keys=True, separators=(",", ":")).encode()


def test_a_typed_plan_survives_its_wire_form() -> None:
    plan = _plan(("a", FACT_A), ("b", FACT_B))
    assert LoadPlan.from_wire(json.loads(json.dumps(plan.to_wire()))) == plan


def test_only_the_signers_own_plans_verify() -> None:
    plan = _plan(("a", FACT_A))
    params = SIGNER.kv_transfer_params(plan)
    assert SIGNER.verified(params) == plan
    altered = {"inferscale": {**params["inferscale"], "plan": {**plan.to_wire(), "user_id": "victim"}}}
    assert SIGNER.verified(altered) is None
    assert PlanSigner(b"o" * 32).verified(params) is None
    unsigned = {"inferscale": {"plan": plan.to_wire()}}
    bad: list[object] = [None, "x", [], {"inferscale": None}, unsigned,
                         {"inferscale": {"plan": plan.to_wire(), "sig": 5}}]
    for params_value in bad:
        assert SIGNER.verified(params_value) is None


def test_the_cache_salt_is_bound_to_the_plan_and_the_secret() -> None:
    plan = _plan(("a", FACT_A))
    salt = SIGNER.cache_salt(plan)
    assert salt.startswith("isk-") and salt == SIGNER.cache_salt(_plan(("a", FACT_A)))
    assert salt != SIGNER.cache_salt(_plan(("b", FACT_B)))
    assert salt != PlanSigner(b"o" * 32).cache_salt(plan)


def test_equal_tokens_under_one_salt_are_the_same_kv_so_reused_blocks_are_never_another_facts() -> None:
    """Injected blocks are reused only by a request of the very same plan: the same tokens with other KV (another
    context window's encoding, a fact re-encoded after its turns changed, another version), a plan that leaves a
    fact to prefill (a recomputed tail), or another user's plan, are each salted apart (why a user-wide salt would
    not be safe: PlanSigner.cache_salt)."""
    plan = _plan(("a", FACT_A))
    header = PlanHeader(content_id(PROFILE, [], HEADER), tuple(HEADER))
    other_kv = LoadPlan(PROFILE, "u1", header, (PlanFact("a", 1, content_id(PROFILE, [7], FACT_A), tuple(FACT_A)),))
    re_encoded = LoadPlan(PROFILE, "u1", header, (PlanFact("a", 2, plan.facts[0].content_id, tuple(FACT_A)),))
    header_only = LoadPlan(PROFILE, "u1", header, ())  # the fact left to prefill
    salts = {SIGNER.cache_salt(p) for p in (plan, other_kv, re_encoded, header_only, _plan(("a", FACT_A), user="u2"))}
    assert len(salts) == 5 and SIGNER.cache_salt(_plan(("a", FACT_A))) in salts


def test_client_plans_and_reserved_salts_are_stripped_at_any_depth() -> None:
    body = {"kv_transfer_params": {"x": 1}, "cache_salt": "isk-forged", "vllm_xargs": {"kv_transfer_params": {}},
            "requests": [{"kv_transfer_params": None, "cache_salt": "mine"}]}
    assert strip_client_plans(body) == 4
    assert body == {"vllm_xargs": {}, "requests": [{"cache_salt": "mine"}]}
    assert strip_client_plans([1, "a", None]) == 0
