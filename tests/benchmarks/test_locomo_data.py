"""Reading LoCoMo files into the memory service's inputs."""

from __future__ import annotations

from datetime import UTC, datetime

from benchmarks.locomo_data import evidence_ids, load_locomo, parse_session_date


def test_session_dates_parse_as_utc() -> None:
    assert parse_session_date("1:56 pm on 8 May, 2023") == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)


def test_evidence_ids_split_malformed_entries_and_drop_duplicates() -> None:
    assert evidence_ids(["D8:6; D9:17", "D:11:26", "D8:6"]) == ("D8:6", "D9:17", "D11:26")


def test_turns_are_chronological_with_captions_and_sessions_without_turns_are_skipped(locomo_file) -> None:
    conversation = load_locomo(locomo_file)[0]
    assert [t.turn_id for t in conversation.turns] == ["D1:1", "D1:2", "D2:1", "D2:2"]
    assert [t.seq for t in conversation.turns] == [0, 1, 2, 3]
    assert conversation.turns[1].text == "Great, I adopted a dog! [shares a photo: a photo of a dog]"
    assert conversation.turns[2].session_id == "session_2"


def test_facts_carry_their_source_turn_and_its_session_date(locomo_file) -> None:
    facts = load_locomo(locomo_file)[0].facts
    assert [(f.text, f.source_turn_id) for f in facts] == [
        ("Bo adopted a dog in May 2023.", "D1:2"), ("Ana started pottery classes.", "D2:1"),
        ("Bo went hiking in the Alps.", "D2:2")]
    assert facts[1].timestamp.ToDatetime(tzinfo=UTC).month == 6
    assert len({f.fact_id for f in facts}) == 3


def test_questions_exclude_category_5_and_answers_become_strings(locomo_file) -> None:
    questions = load_locomo(locomo_file)[0].questions
    assert [(q.category, q.answer) for q in questions] == [(4, "a dog"), (2, "2023")]
    assert questions[1].evidence == ("D2:1", "D1:1")
