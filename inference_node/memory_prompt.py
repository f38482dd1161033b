"""What the middleware puts in a request: the memory block (one fact per line, best last), and for kv mode
the load plan (inference_node.plan) that the connector verifies against the prompt's actual token ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference_node.plan import LoadPlan, PlanFact, PlanHeader
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import MEMORY_INSTRUCTION, fact_line
from inferscale_kv.stored_text import StoredTextGuard


@dataclass(frozen=True)
class MemoryPlan:
    facts: list[pb.RetrievedFact]  # in prompt order
    block_text: str
    plan: LoadPlan  # unsigned
    injectable_tokens: int
    kv_facts: int


def has_kv(fact: pb.RetrievedFact) -> bool:
    return fact.kv_ready and bool(fact.token_ids) and bool(fact.content_id)


def by_rank_descending(fact: pb.RetrievedFact) -> int:
    return -fact.rank


def by_creation(fact: pb.RetrievedFact) -> tuple[int, int, str]:
    """A user's facts in the order they were first stored: the same relative order in every request, so that
    consecutive text prompts of a user share their longest common prefix (vLLM's prefix cache can hit)."""
    return fact.created_at.seconds, fact.created_at.nanos, fact.fact_id


FACT_ORDERS: dict[str, Callable[[pb.RetrievedFact], Any]] = {"ranked": by_rank_descending, "created": by_creation}


def order_facts(facts: list[pb.RetrievedFact],
                key: Callable[[pb.RetrievedFact], Any] = by_rank_descending) -> list[pb.RetrievedFact]:
    """Prompt order: facts with KV first, then the rest (prefilled), each part sorted by `key` (default: best
    ranked last, the node's order).

    Only a prompt prefix can be loaded, so facts to be prefilled go after the injectable ones; text mode
    uses the same order so that both modes see the same prompt.
    """
    ready = sorted((f for f in facts if has_kv(f)), key=key)
    other = sorted((f for f in facts if not has_kv(f)), key=key)
    return ready + other


def plan_memory(facts: list[pb.RetrievedFact], header_ids: list[int], header_content_id: str, profile_id: str,
                user_id: str, key: Callable[[pb.RetrievedFact], Any] = by_rank_descending,
                recompute_tail_facts: int = 0, *, guard: StoredTextGuard) -> MemoryPlan:
    """The memory block and load plan for retrieved facts in `order_facts(facts, key)` order: each fact's line as
    the worker tokenized it (`guard`: the node's tokenizer's). Without header KV (`header_content_id` empty) nothing
    can be injected: every fact is text.

    `recompute_tail_facts` = m leaves the last m facts with KV (in the ranked order, the m nearest the question)
    out of the plan: vLLM prefills them after the injected ones, so they attend to the header and every fact
    before them. The prompt is the same whatever m is; only what is injected changes."""
    if not header_content_id:
        facts = [pb.RetrievedFact(fact_id=f.fact_id, version=f.version, text=f.text, score=f.score, rank=f.rank,
                                  created_at=f.created_at) for f in facts]
    ordered = order_facts(facts, key)
    block = "".join(fact_line(guard, fact.text) for fact in ordered)
    injected = [PlanFact(f.fact_id, f.version, f.content_id, tuple(f.token_ids)) for f in ordered if has_kv(f)]
    injected = injected[: max(len(injected) - recompute_tail_facts, 0)]
    plan = LoadPlan(profile_id, user_id, PlanHeader(header_content_id, tuple(header_ids)), tuple(injected))
    tokens = len(header_ids) + sum(len(fact.token_ids) for fact in injected) if header_content_id else 0
    return MemoryPlan(ordered, block, plan, tokens, len(injected))


def system_content(block: str, client_system: str) -> str:
    content = f"{MEMORY_INSTRUCTION}\n{block}"
    return f"{content}{client_system}" if client_system else content
