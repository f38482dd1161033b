"""Reading LoCoMo files into the memory service's inputs."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from benchmarks.locomo_data import evidence_ids, load_locomo, parse_session_date
from tests.benchmarks.conftest import locomo_sample


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


def test_a_fact_citing_several_turns_keeps_them_all_its_first_as_source_turn(tmp_path) -> None:
    sample = locomo_sample("conv-a", "dog")
    sample["observation"]["session_2_observation"]["Bo"].append(["Bo and Ana met twice.", ["D1:2", "D2:1", "D9:9"]])
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([sample]))
    conversation = load_locomo(path)[0]
    fact = conversation.facts[-1]
    assert fact.source_turn_id == "D1:2"  # D9:9 is no turn of the conversation
    assert conversation.fact_sources[fact.fact_id] == ("D1:2", "D2:1")
    assert conversation.fact_sources[conversation.facts[0].fact_id] == ("D1:2",)


def test_coverage_is_the_share_of_evidence_turns_some_fact_cites(locomo_file) -> None:
    conversation = load_locomo(locomo_file)[0]
    adopt, pottery = conversation.questions
    assert conversation.coverage(adopt) == 1.0
    assert conversation.coverage(pottery) == 0.5  # D1:1 is the source of no observation


def test_turn_facts_are_every_turn_with_its_speaker_caption_and_session_date(locomo_file) -> None:
    conversation = load_locomo(locomo_file, fact_set="turns")[0]
    assert [(f.source_turn_id, f.text) for f in conversation.facts] == [
        ("D1:1", "Ana: Hi Bo, how was your week?"),
        ("D1:2", "Bo: Great, I adopted a dog! [shares a photo: a photo of a dog]"),
        ("D2:1", "Ana: I started pottery classes."), ("D2:2", "Bo: Nice, I went hiking in the Alps.")]
    assert conversation.facts[2].timestamp.ToDatetime(tzinfo=UTC) == datetime(2023, 6, 9, 10, 0, tzinfo=UTC)
    assert conversation.facts[0].metadata["speaker"] == "Ana"
    assert all(conversation.coverage(question) == 1.0 for question in conversation.questions)


def test_both_fact_sets_together_keep_each_fact_and_its_sources(locomo_file) -> None:
    observations = load_locomo(locomo_file)[0]
    turns = load_locomo(locomo_file, fact_set="turns")[0]
    both = load_locomo(locomo_file, fact_set="both")[0]
    assert list(both.facts) == [*observations.facts, *turns.facts]
    assert both.fact_sources == {**observations.fact_sources, **turns.fact_sources}
    assert len({fact.fact_id for fact in both.facts}) == len(both.facts)
    assert all(both.coverage(question) == 1.0 for question in both.questions)


def test_an_unknown_fact_set_is_refused(locomo_file) -> None:
    with pytest.raises(ValueError, match="fact_set"):
        load_locomo(locomo_file, fact_set="sessions")


def test_an_output_folder_keeps_to_one_fact_set(tmp_path) -> None:
    from benchmarks.locomo import claim_output

    claim_output(tmp_path / "run", "observations")
    claim_output(tmp_path / "run", "observations")  # a rerun resumes
    with pytest.raises(SystemExit, match="--facts observations, not turns"):
        claim_output(tmp_path / "run", "turns")
