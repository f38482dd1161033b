"""Placing a retrieved memory in the request's prompt: the facts kept within memory.max_tokens, planned
(memory_prompt.plan_memory: one per line, best last, each in its neutral form: never a control token) and written in
front of the question: as a system message on /v1/chat/completions, with the rendered prompt's token ids in
`kv_transfer_params.prompt_token_ids` where vLLM takes them (it then neither renders nor tokenizes the memory) and
the request renders plainly; on /v1/completions as token ids (the layout's tokenization, memory_prompt.MemoryTokens),
or as text without added special tokens for a tokenizer whose pieces do not concatenate (the header carries the BOS).

In kv mode, unless the service holds no header KV or the injectable memory is shorter than the crossover (prefilling
it is then faster), the signed load plan (`kv_transfer_params`) and its signed `cache_salt` go with it; otherwise the
user's own salt (a prefilled memory is reusable by that user's requests only). Counts the facts placed, by how, and
writes the x-inferscale-memory summary's fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import Counter

from inference_node.memory_prompt import (
    DEFAULT_MAX_PROMPT_TOKENS,
    FACT_ORDERS,
    FactLines,
    MemoryPlan,
    MemoryTokens,
    has_kv,
    plan_memory,
    system_content,
)
from inference_node.memory_request import MemoryRequest, text_of
from inference_node.plan import PlanFact, PlanSigner, plan_secret_from_env
from inference_node.retrieval import Retrieved
from inference_node.settings import NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.stored_text import StoredTextGuard

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FACTS_PLACED = Counter("inferscale_node_facts", "facts placed in prompts, by how", ["how"])


@dataclass(frozen=True)
class PromptParts:
    """What placing a memory takes of the model's tokenizer: the memory header (ids and text), each fact's line and
    the memory's token ids."""

    header_ids: list[int]
    header_text: str
    fact_lines: FactLines
    memory_tokens: MemoryTokens

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int = 0) -> PromptParts:
        """The parts of `tokenizer`'s prompts; none of more than `max_prompt_tokens` (0: DEFAULT_MAX_PROMPT_TOKENS)
        tokenized here."""
        tokens = MemoryTokens(tokenizer, max_prompt_tokens=max_prompt_tokens or DEFAULT_MAX_PROMPT_TOKENS)
        return cls(tokens.header_ids, tokens.header_text, FactLines(StoredTextGuard.for_tokenizer(tokenizer)), tokens)


@dataclass(frozen=True)
class Placed:
    """A memory placed in a request: the body members to add (already JSON), and whether a signed load plan is
    among them (its answer then says what became of the memory)."""

    members: dict[str, bytes]
    signed_plan: bool


class MemoryPlacement:
    """Puts retrieved memories in requests (the model's tokenizer loaded on first use) and signs their load plans."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self._signer = PlanSigner(plan_secret_from_env())
        self._parts: PromptParts | None = None
        self._chat_token_ids = settings.chat_token_ids and vllm_takes_chat_prompt_ids()

    def prepare(self) -> PromptParts:
        """The prompt's parts, from the model's tokenizer (loaded on the first call; a failure leaves nothing set, and
        the next call tries again). Called before the memory service is asked for a request's facts."""
        if self._parts is None:
            from transformers import AutoTokenizer

            self._parts = PromptParts.for_tokenizer(AutoTokenizer.from_pretrained(self.settings.model_dir),
                                                    self.settings.max_model_len)
        return self._parts

    def place(self, payload: dict, path: str, memory: MemoryRequest, retrieved: Retrieved,
              summary: dict[str, Any]) -> Placed:
        """Puts the memory in the request: in `payload`, or, for what holds every token id of the memory (the signed
        load plan, a token-id prompt, a chat prompt's ids), in the body members it returns, already JSON; its fields
        in `summary`."""
        parts = self.prepare()
        response = retrieved.response
        facts = list(response.facts)
        if memory.max_tokens:
            facts = parts.memory_tokens.within_budget(facts, memory.max_tokens)
            summary.update(max_tokens=memory.max_tokens, facts_retrieved=len(response.facts))
        plan = plan_memory(facts, parts.header_ids, response.header_content_id,
                           self.settings.profile_id, memory.user_id, FACT_ORDERS[memory.order],
                           memory.recompute_tail_facts if memory.mode == "kv" else 0, lines=parts.fact_lines)
        written = _write_prompt(payload, path, plan, parts, self._chat_token_ids)
        members = written.members
        summary.update(facts=len(plan.facts), stage_ms=round(retrieved.seconds * 1000, 2), order=memory.order)
        if not response.header_content_id:
            summary.update(header_kv="missing")
        inject = memory.mode == "kv" and bool(response.header_content_id)
        if inject and plan.injectable_tokens < memory.kv_crossover_tokens:
            # Shorter than the crossover: prefilling it is faster than injecting it.
            inject = False
            summary.update(served_as="text", kv_crossover_tokens=memory.kv_crossover_tokens)
        signed_params = None
        if inject:
            signed = self._signer.sign(plan.plan, warm_up_facts(retrieved.warm_up), memory.user_token)
            signed_params = signed.kv_transfer_params_json
            payload["cache_salt"] = signed.cache_salt
            summary.update(kv_facts=plan.kv_facts, injectable_tokens=plan.injectable_tokens)
            FACTS_PLACED.labels(how="kv").inc(plan.kv_facts)
            FACTS_PLACED.labels(how="text").inc(len(plan.facts) - plan.kv_facts)
        else:  # the memory is prefilled: reusable by this user's requests only
            payload["cache_salt"] = self._signer.user_salt(self.settings.profile_id, memory.user_id)
            FACTS_PLACED.labels(how="text").inc(len(plan.facts))
        if memory.mode == "kv" and not inject:
            summary.update(kv_facts=0, injectable_tokens=0)
        if written.chat_prompt_ids is not None:
            summary.update(prompt="token_ids")
        params = _kv_transfer_params(written.chat_prompt_ids, signed_params)
        if params is not None:
            members["kv_transfer_params"] = params
        return Placed(members, inject)


def _kv_transfer_params(prompt_ids: bytes | None, signed_params: bytes | None) -> bytes | None:
    """The request's kv_transfer_params (JSON): the chat prompt's ids (vLLM takes them out) beside the signed plan's
    members; None where there is neither."""
    if prompt_ids is None:
        return signed_params
    return b'{"prompt_token_ids":%s%s' % (prompt_ids, b"," + signed_params[1:] if signed_params else b"}")


def warm_up_facts(facts: Sequence[pb.RetrievedFact]) -> tuple[PlanFact, ...]:
    """The facts of a warm-up that have KV, as a plan names them."""
    return tuple(PlanFact(fact.fact_id, fact.version, fact.content_id, tuple(fact.token_ids)) for fact in facts
                 if has_kv(fact))


@dataclass(frozen=True)
class WrittenPrompt:
    """A memory written into a request: the body members to add (already JSON), and on the chat route the rendered
    prompt's token ids (JSON) for vLLM to take instead of rendering and tokenizing the messages, where it can."""

    members: dict[str, bytes]
    chat_prompt_ids: bytes | None = None


def _write_prompt(payload: dict, path: str, plan: MemoryPlan, parts: PromptParts,
                  chat_token_ids: bool) -> WrittenPrompt:
    """Puts the memory block in front of the request's question, in `payload` or (a token-id prompt) in the body
    members it returns; on the chat route with `chat_token_ids`, the prompt's ids too where the request renders
    plainly (`renders_plainly`)."""
    if path == "/v1/chat/completions":
        messages = payload.get("messages", [])
        client_system = ""
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
            client_system = text_of(messages.pop(0).get("content"), "messages[0].content")
        payload["messages"] = [{"role": "system", "content": system_content(plan.block_text, client_system)},
                               *messages]
        if chat_token_ids and parts.memory_tokens.chat_concatenative and renders_plainly(payload):
            try:
                rendered = parts.memory_tokens.render_chat(payload["messages"],
                                                           payload.get("add_generation_prompt", True))
            except Exception:  # the template refuses these messages: vLLM renders them and answers that itself
                return WrittenPrompt({})
            ids = parts.memory_tokens.rendered_prompt(plan.facts, parts.fact_lines, rendered)
            if ids is not None:
                return WrittenPrompt({}, msgspec.json.encode(ids))
        return WrittenPrompt({})
    # As token ids where they can be: vLLM would tokenize the whole memory again on every request.
    prompt_ids = parts.memory_tokens.prompt(plan.facts, parts.fact_lines, payload.get("prompt") or "") if (
        parts.memory_tokens.concatenative) else None
    if prompt_ids is not None:
        payload.pop("prompt", None)
        return WrittenPrompt({"prompt": msgspec.json.encode(prompt_ids)})
    payload["prompt"] = parts.header_text + plan.block_text + (payload.get("prompt") or "")
    # The header text carries the template's BOS: a second one would shift every position.
    payload["add_special_tokens"] = False
    return WrittenPrompt({})


# The chat request fields that leave vLLM's rendering of the prompt as it is (sampling, output and scheduling), and
# the message roles every chat template knows: a request with any other field, or a message with other keys or with
# content that is not one string, is rendered by vLLM from its messages.
PROMPT_NEUTRAL_CHAT_FIELDS = frozenset({
    "model", "messages", "add_generation_prompt", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "max_tokens", "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "user", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens",
    "allowed_token_ids", "bad_words", "structured_outputs", "priority", "request_id", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt"})
PLAIN_ROLES = frozenset({"system", "user", "assistant"})


def renders_plainly(payload: dict) -> bool:
    """Whether vLLM renders this chat request's prompt as the template renders its messages alone: only fields of
    PROMPT_NEUTRAL_CHAT_FIELDS, `add_generation_prompt` a boolean, every message a role of PLAIN_ROLES with one
    string of content."""
    messages = payload.get("messages")
    return (payload.keys() <= PROMPT_NEUTRAL_CHAT_FIELDS
            and isinstance(payload.get("add_generation_prompt", True), bool) and isinstance(messages, list)
            and all(isinstance(message, dict) and message.keys() == {"role", "content"}
                    and message["role"] in PLAIN_ROLES and isinstance(message["content"], str)
                    for message in messages))


def vllm_takes_chat_prompt_ids() -> bool:
    """Whether this vLLM takes a chat request's prompt ids from its kv_transfer_params (`prompt_token_ids`: the
    decode-side reuse of disaggregated serving, vllm-project/vllm#48145, after 0.26) instead of rendering and
    tokenizing its messages. An older one would carry them to the engine unread: they are not sent there."""
    try:
        from vllm.renderers import online_renderer
    except ImportError:
        return False
    return hasattr(online_renderer, "_reused_prompt_token_ids")
