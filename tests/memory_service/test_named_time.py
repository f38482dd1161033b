"""The hybrid ranking's date rule: the month and year a query names, and the verbs "may" and "march" that name
none."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from memory_service.models import ScoredFact, StoredFact
from memory_service.retrieval import NamedTime, fuse, named_time


@pytest.mark.parametrize(("query", "expected"), [
    ("What did Ana do in June 2023?", NamedTime(6, 2023)),
    ("Who did Maria have dinner with on May 3, 2023?", NamedTime(5, 2023)),
    ("What movie did Joanna watch on 1 May, 2022?", NamedTime(5, 2022)),
    ("Which outdoor spot did Joanna visit in May?", NamedTime(5, None)),
    ("what did ana do in june?", NamedTime(6, None)),  # month names count in lower case...
    ("Did Andrew have a pet dog during March 2023?", NamedTime(3, 2023)),
    ("May 2023 was busy: what did Ana do?", NamedTime(5, 2023)),  # opening a sentence, with a number after it
    ("What did Ana do in 2022?", NamedTime(None, 2022)),
    ("what did ana do in may 2023?", NamedTime(5, 2023)),  # ...and so do the verbs' with a number after them
    ("did ana hike on march 8?", NamedTime(3, None)),
])
def test_a_named_month_and_year_are_read(query: str, expected: NamedTime) -> None:
    assert named_time(query) == expected


@pytest.mark.parametrize("query", [
    "May I ask where Ana went hiking?",  # the modal verb opening a question
    "Thanks. May we talk about Ana's dog?",
    "Ana may go hiking, where?",  # ...except "may" and "march", verbs in lower case
    "Why did they march through the town?",
    "What does Ana like?",
])
def test_verbs_spelled_as_months_name_no_time(query: str) -> None:
    assert named_time(query) is None


def test_may_opening_a_question_keeps_the_month_named_later() -> None:
    assert named_time("May I ask what Ana did in June?") == NamedTime(6, None)


def _fact(fact_id: str, month: int) -> ScoredFact:
    stamp = int(datetime(2023, month, 10, tzinfo=UTC).timestamp() * 1e6)
    return ScoredFact(StoredFact(user_id="u", fact_id=fact_id, text="Ana went hiking.", source_turn_id="",
                                 timestamp_us=stamp, metadata={}, version=1, created_at_us=0, updated_at_us=0), 0.5)


def test_hybrid_gives_no_date_bonus_for_may_i() -> None:
    june, may = _fact("a-june", 6), _fact("b-may", 5)
    assert [s.fact.fact_id for s in fuse([june, may], [], "May I ask where Ana went hiking?", 2)] == ["a-june", "b-may"]
    assert [s.fact.fact_id for s in fuse([june, may], [], "Where did Ana go hiking in May?", 2)] == ["b-may", "a-june"]
