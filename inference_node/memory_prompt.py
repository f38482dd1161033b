"""What the middleware puts in a request: the memory block (one fact per line, best last), and for kv mode
the load plan that the connector verifies against the prompt's actual token ids."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference_node.settings import HEADER_CHUNK, PARAMS_KEY
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import MEMORY_INSTRUCTION


@dataclass(frozen=True)
class MemoryPlan:
    facts: list[pb.RetrievedFact]  # in prompt order
    block_text: str
    kv_params: dict
    injectable_tokens: int
    kv_facts: int


def by_rank_descending(fact: pb.RetrievedFact) -> int:
    return -fact.rank


def order_facts(facts: list[pb.RetrievedFact],
                key: Callable[[pb.RetrievedFact], Any] = by_rank_descending) -> list[pb.RetrievedFact]:
    """Prompt order: facts with KV first, then the rest (prefilled), each part sorted by `key` (default: best
    ranked last, the node's order).

    Only a prompt prefix can be loaded, so facts to be prefilled go after the injectable ones; text mode
    uses the same order so that both modes see the same prompt.
    """
    ready = sorted((f for f in facts if f.kv_ready and f.token_ids), key=key)
    other = sorted((f for f in facts if not (f.kv_ready and f.token_ids)), key=key)
    return ready + other


def plan_memory(facts: list[pb.RetrievedFact], header_ids: list[int], profile_id: str, user_id: str,
                key: Callable[[pb.RetrievedFact], Any] = by_rank_descending) -> MemoryPlan:
    """The memory block and load plan for retrieved facts in `order_facts(facts, key)` order."""
    ordered = order_facts(facts, key)
    block = "".join(fact.text.strip() + "\n" for fact in ordered)
    chunks = [{"fact_id": HEADER_CHUNK, "version": 1, "token_ids": list(header_ids)}]
    chunks += [{"fact_id": f.fact_id, "version": f.version, "token_ids": list(f.token_ids)}
               for f in ordered if f.kv_ready and f.token_ids]
    kv_params = {PARAMS_KEY: {"profile_id": profile_id, "user_id": user_id, "chunks": chunks}}
    return MemoryPlan(ordered, block, kv_params, sum(len(c["token_ids"]) for c in chunks), len(chunks) - 1)


def cache_salt(profile_id: str, user_id: str, plan: MemoryPlan) -> str:
    """Keeps injected blocks out of every other request's prefix-cache lookups; only a request injecting the
    same facts (same versions) for the same user and profile can reuse them."""
    facts = ",".join(f"{c['fact_id']}@{c['version']}" for c in plan.kv_params[PARAMS_KEY]["chunks"])
    return "isk-" + hashlib.sha256(f"{profile_id}|{user_id}|{facts}".encode()).hexdigest()[:32]


def system_content(block: str, client_system: str) -> str:
    content = f"{MEMORY_INSTRUCTION}\n{block}"
    return f"{content}{client_system}" if client_system else content
