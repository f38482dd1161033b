"""The hybrid ranking of a user's facts: the vector and keyword rankings fused by a linear combination of their scores,
and a date the query names matched against the facts' timestamps.

A fact's hybrid score is VECTOR_WEIGHT x its cosine + (1 - VECTOR_WEIGHT) x its BM25 score over the best BM25 score
of the query (0 where it shares no word with the query), plus DATE_MATCH_BONUS where the query names a month or a
year (`named_time`: "in June", "in 2023", "on 8 May, 2023"; not the verbs "may" and "march") and the fact's
timestamp falls in it. Each ranking contributes its best `candidates(top_k)` facts; a keyword candidate outside the
vector candidates counts the lowest candidate cosine. In every mode, scores equal to SCORE_DECIMALS decimals tie,
broken by fact_id (`rank_key`), so that every replica answers a query over the same facts with the same ranks,
whatever order its arithmetic took. The weights and the rule were chosen on LoCoMo (benchmarks/RESULTS.md, "Retrieval
modes on LoCoMo")."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from inferscale_kv.limits import HYBRID_CANDIDATES
from memory_service.models import ScoredFact

VECTOR_WEIGHT = 0.85
DATE_MATCH_BONUS = 0.1
SCORE_DECIMALS = 6  # float32 sums of the same terms differ in their last digits with the order of the terms

_MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december")
_MONTH = re.compile(r"\b(" + "|".join(_MONTHS) + r")\b", re.IGNORECASE)
_ALSO_VERBS = ("may", "march")
_NUMBER_FOLLOWS = re.compile(r"\s+\d")
_YEAR = re.compile(r"\b(19\d\d|20\d\d)\b")


@dataclass(frozen=True)
class NamedTime:
    """The month (1-12) and year a query names, either or both."""

    month: int | None
    year: int | None

    def holds(self, timestamp_us: int) -> bool:
        """Whether a fact stamped `timestamp_us` (0: no timestamp) falls in it."""
        if timestamp_us <= 0:
            return False
        when = datetime.fromtimestamp(timestamp_us / 1e6, UTC)
        return (self.month is None or when.month == self.month) and (self.year is None or when.year == self.year)


def named_time(query: str) -> NamedTime | None:
    """The first month and the first year (1900-2099) the query names; None when it names neither.

    A month is its name in any case, except the two that are also verbs: "may" and "march" count with a number after
    them ("in may 2023", "march 8"), else only capitalized and not opening a sentence ("in May", not "May I ...")."""
    month, year = _named_month(query), _YEAR.search(query)
    if month is None and year is None:
        return None
    return NamedTime(month, int(year.group(1)) if year else None)


def _named_month(query: str) -> int | None:
    for match in _MONTH.finditer(query):
        name = match.group(1)
        before = query[:match.start()].rstrip(" \t\n\"'(")
        opens_sentence = not before or before.endswith((".", "!", "?"))
        number_follows = _NUMBER_FOLLOWS.match(query, match.end()) is not None
        if name.lower() in _ALSO_VERBS and not number_follows and (not name[0].isupper() or opens_sentence):
            continue
        return _MONTHS.index(name.lower()) + 1
    return None


def rank_key(score: float, fact_id: str) -> tuple[float, str]:
    """Sort key of a scored fact, best first: its score to SCORE_DECIMALS, then its fact_id."""
    return -round(score, SCORE_DECIMALS), fact_id


def candidates(top_k: int) -> int:
    """How many facts each ranking contributes to a hybrid top-k."""
    return max(top_k, HYBRID_CANDIDATES)


def fuse(by_vector: Sequence[ScoredFact], by_keyword: Sequence[ScoredFact], query: str,
         top_k: int) -> list[ScoredFact]:
    """The hybrid top-k of the two rankings (each best first: cosine, BM25 scores), best first, with their hybrid
    scores."""
    facts = {scored.fact.fact_id: scored.fact for scored in [*by_vector, *by_keyword]}
    cosine = {scored.fact.fact_id: scored.score for scored in by_vector}
    floor = min(cosine.values(), default=0.0)
    best_bm25 = max((scored.score for scored in by_keyword), default=0.0)
    bm25 = {scored.fact.fact_id: scored.score / best_bm25 for scored in by_keyword} if best_bm25 > 0 else {}
    when = named_time(query)
    score = {}
    for fact_id, fact in facts.items():
        score[fact_id] = VECTOR_WEIGHT * cosine.get(fact_id, floor) + (1 - VECTOR_WEIGHT) * bm25.get(fact_id, 0.0)
        if when is not None and when.holds(fact.timestamp_us):
            score[fact_id] += DATE_MATCH_BONUS
    best = sorted(score, key=lambda fact_id: rank_key(score[fact_id], fact_id))[:top_k]
    return [ScoredFact(fact=facts[fact_id], score=score[fact_id]) for fact_id in best]
