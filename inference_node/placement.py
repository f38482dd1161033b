"""Placing a retrieved memory in the request's prompt: the facts kept within memory.max_tokens, planned
(memory_prompt.plan_memory: one per line, best last, each in its neutral form: never a control token) and written in
front of the question: as a system message on /v1/chat/completions; on /v1/completions as token ids (the layout's
tokenization, memory_prompt.MemoryTokens), or as text without added special tokens for a tokenizer whose pieces do
not concatenate (the header carries the BOS).

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
from inferscale_kv.layout import memory_header_ids, memory_header_text
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
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> PromptParts:
        return cls(memory_header_ids(tokenizer), memory_header_text(tokenizer),
                   FactLines(StoredTextGuard.for_tokenizer(tokenizer)), MemoryTokens(tokenizer))


class MemoryPlacement:
    """Puts retrieved memories in requests (the model's tokenizer loaded on first use) and signs their load plans."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self._signer = PlanSigner(plan_secret_from_env())
        self._parts: PromptParts | None = None

    def prepare(self) -> PromptParts:
        """The prompt's parts, from the model's tokenizer (loaded on the first call; a failure leaves nothing set, and
        the next call tries again). Called before the memory service is asked for a request's facts."""
        if self._parts is None:
            from transformers import AutoTokenizer

            self._parts = PromptParts.for_tokenizer(AutoTokenizer.from_pretrained(self.settings.model_dir))
        return self._parts

    def place(self, payload: dict, path: str, memory: MemoryRequest, retrieved: Retrieved,
              summary: dict[str, Any]) -> dict[str, bytes]:
        """Puts the memory in the request: in `payload`, or, for what holds every token id of the memory (the signed
        load plan, a token-id prompt), in the body members it returns, already JSON; its fields in `summary`."""
        parts = self.prepare()
        response = retrieved.response
        facts = list(response.facts)
        if memory.max_tokens:
            facts = parts.memory_tokens.within_budget(facts, memory.max_tokens)
            summary.update(max_tokens=memory.max_tokens, facts_retrieved=len(response.facts))
        plan = plan_memory(facts, parts.header_ids, response.header_content_id,
                           self.settings.profile_id, memory.user_id, FACT_ORDERS[memory.order],
                           memory.recompute_tail_facts if memory.mode == "kv" else 0, lines=parts.fact_lines)
        members = _write_prompt(payload, path, plan, parts)
        summary.update(facts=len(plan.facts), stage_ms=round(retrieved.seconds * 1000, 2), order=memory.order)
        if not response.header_content_id:
            summary.update(header_kv="missing")
        inject = memory.mode == "kv" and bool(response.header_content_id)
        if inject and plan.injectable_tokens < memory.kv_crossover_tokens:
            # Shorter than the crossover: prefilling it is faster than injecting it.
            inject = False
            summary.update(served_as="text", kv_crossover_tokens=memory.kv_crossover_tokens)
        if inject:
            signed = self._signer.sign(plan.plan, warm_up_facts(retrieved.warm_up), memory.user_token)
            members["kv_transfer_params"] = signed.kv_transfer_params_json
            payload["cache_salt"] = signed.cache_salt
            summary.update(kv_facts=plan.kv_facts, injectable_tokens=plan.injectable_tokens)
            FACTS_PLACED.labels(how="kv").inc(plan.kv_facts)
            FACTS_PLACED.labels(how="text").inc(len(plan.facts) - plan.kv_facts)
        else:  # the memory is prefilled: reusable by this user's requests only
            payload["cache_salt"] = self._signer.user_salt(self.settings.profile_id, memory.user_id)
            FACTS_PLACED.labels(how="text").inc(len(plan.facts))
        if memory.mode == "kv" and not inject:
            summary.update(kv_facts=0, injectable_tokens=0)
        return members


def warm_up_facts(facts: Sequence[pb.RetrievedFact]) -> tuple[PlanFact, ...]:
    """The facts of a warm-up that have KV, as a plan names them."""
    return tuple(PlanFact(fact.fact_id, fact.version, fact.content_id, tuple(fact.token_ids)) for fact in facts
                 if has_kv(fact))


def _write_prompt(payload: dict, path: str, plan: MemoryPlan, parts: PromptParts) -> dict[str, bytes]:
    """Puts the memory block in front of the request's question, in `payload` or (a token-id prompt) in the body
    members it returns, already JSON."""
    if path == "/v1/chat/completions":
        messages = payload.get("messages", [])
        client_system = ""
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
            client_system = text_of(messages.pop(0).get("content"), "messages[0].content")
        payload["messages"] = [{"role": "system", "content": system_content(plan.block_text, client_system)},
                               *messages]
    elif parts.memory_tokens.concatenative:
        # As token ids: vLLM would tokenize the whole memory again on every request.
        prompt_ids = parts.memory_tokens.prompt(plan.facts, payload.pop("prompt", None) or "")
        return {"prompt": msgspec.json.encode(prompt_ids)}
    else:
        payload["prompt"] = parts.header_text + plan.block_text + (payload.get("prompt") or "")
        # The header text carries the template's BOS: a second one would shift every position.
        payload["add_special_tokens"] = False
    return {}
