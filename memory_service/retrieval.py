"""Fusion of a user's vector and keyword rankings into the hybrid one: reciprocal-rank fusion (Cormack et al., 2009),
a fact scoring the sum over the rankings it is in of 1 / (RRF_K + rank), ties broken by fact_id, so that every
replica answers a query over the same facts with the same ranks."""

from __future__ import annotations

from collections.abc import Sequence

from memory_service.models import ScoredFact

RRF_K = 60  # the usual constant: a fact's fused score is dominated by neither ranking's head
HYBRID_CANDIDATES = 100  # each ranking contributes at least this many of its best facts to the fusion


def candidates(top_k: int) -> int:
    """How many facts each ranking contributes to a hybrid top-k."""
    return max(top_k, HYBRID_CANDIDATES)


def reciprocal_rank_fusion(rankings: Sequence[Sequence[ScoredFact]], top_k: int) -> list[ScoredFact]:
    """The top-k of the fused rankings (each best first), best first, scored by their fused score."""
    fused: dict[str, float] = {}
    facts: dict[str, ScoredFact] = {}
    for ranking in rankings:
        for rank, scored in enumerate(ranking, start=1):
            fact_id = scored.fact.fact_id
            fused[fact_id] = fused.get(fact_id, 0.0) + 1.0 / (RRF_K + rank)
            facts.setdefault(fact_id, scored)
    best = sorted(fused, key=lambda fact_id: (-fused[fact_id], fact_id))[:top_k]
    return [ScoredFact(fact=facts[fact_id].fact, score=fused[fact_id]) for fact_id in best]
