"""The LoCoMo quality harness's own logic: answer metrics, recall, the stratified subset, NLL, variants, the
per-category summary, resumable results and the report."""

from __future__ import annotations

import math
import random

import pytest
import torch

from benchmarks.locomo import (
    ResultCache,
    Variant,
    answer_nll,
    build_variants,
    markdown_report,
    normalize_answer,
    order_key,
    paired_bootstrap,
    recall_at,
    recall_report,
    stratified_subset,
    summarize,
    summarize_recall,
    token_f1,
)
from benchmarks.locomo_data import LocomoQuestion
from inferscale.v1 import memory_pb2 as pb


def test_normalize_answer_drops_case_punctuation_and_articles() -> None:
    assert normalize_answer("The Red-Car, an apple!") == ["redcar", "apple"]


def test_token_f1_is_one_for_equal_answers_up_to_normalization() -> None:
    assert token_f1("A dog.", "the DOG") == 1.0


def test_token_f1_is_the_harmonic_mean_of_token_precision_and_recall() -> None:
    assert token_f1("red car", "a red bike") == pytest.approx(0.5)
    assert token_f1("red red car", "red") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("blue", "red") == 0.0


def test_token_f1_of_an_empty_answer_is_one_only_against_an_empty_gold() -> None:
    assert token_f1("", "the") == 1.0
    assert token_f1("", "dog") == 0.0


def test_recall_at_k_counts_evidence_turns_covered_by_the_top_k_sources() -> None:
    ranked = [("D1:2",), ("D3:1",), ("D2:1",), ("D1:2",)]
    assert recall_at(ranked, ("D2:1", "D1:2"), 2) == 0.5
    assert recall_at(ranked, ("D2:1", "D1:2"), 3) == 1.0
    assert recall_at(ranked, ("D9:9",), 50) == 0.0


def test_recall_at_k_is_none_for_questions_without_evidence() -> None:
    assert recall_at([("D1:1",)], (), 5) is None


def test_a_fact_citing_several_turns_covers_every_one_of_them() -> None:
    ranked = [("D3:1",), ("D1:2", "D2:1"), ()]
    assert recall_at(ranked, ("D2:1", "D1:2"), 1) == 0.0
    assert recall_at(ranked, ("D2:1", "D1:2"), 2) == 1.0


def _questions(per_category: dict[int, int]) -> list[LocomoQuestion]:
    return [LocomoQuestion(f"q{category}-{i}", "?", "a", (), category)
            for category, count in per_category.items() for i in range(count)]


def test_stratified_subset_takes_at_most_n_per_category_in_input_order() -> None:
    questions = _questions({1: 5, 2: 1, 4: 3})
    subset = stratified_subset(questions, 2, seed=0)
    assert [q.category for q in subset] == [1, 1, 2, 4, 4]
    assert subset == sorted(subset, key=questions.index)


def test_stratified_subset_is_reproducible_for_a_seed_and_all_questions_without_a_cap() -> None:
    questions = _questions({1: 20, 3: 20})
    assert stratified_subset(questions, 3, seed=7) == stratified_subset(questions, 3, seed=7)
    assert stratified_subset(questions, None, seed=7) == questions


def test_answer_nll_is_the_mean_negative_log_probability_of_the_answer_tokens() -> None:
    logits = torch.zeros(2, 4)
    logits[0, 1] = math.log(3.0)  # token 1 gets 3/6 = 1/2, token 0 gets 1/6 in row 0; row 1 uniform: 1/4
    assert answer_nll(logits, [1, 2]) == pytest.approx((math.log(2) + math.log(4)) / 2)


def test_build_variants_adds_the_fp8_and_chronological_encodings_of_their_windows() -> None:
    variants = build_variants([0, -1], fp8_window=5, order_window=-1)
    assert [(v.name, v.profile_key, v.order) for v in variants] == [
        ("w=0", (0, "float32"), "ranked"), ("w=all", (-1, "float32"), "ranked"),
        ("w=5 fp8", (5, "fp8_e4m3"), "ranked"), ("w=all chronological", (-1, "float32"), "chronological")]
    assert build_variants([20], None, None) == [Variant("w=20", 20)]


def test_build_variants_sweeps_the_tails_at_their_window() -> None:
    variants = build_variants([0, 20], None, None, tails=[0, 2, 5], tail_window=20)
    assert [(v.name, v.profile_key, v.tail) for v in variants] == [
        ("w=0", (0, "float32"), 0), ("w=20", (20, "float32"), 0), ("w=20 tail=2", (20, "float32"), 2),
        ("w=20 tail=5", (20, "float32"), 5)]


def test_paired_bootstrap_brackets_the_mean_difference_and_narrows_with_more_questions() -> None:
    rng = random.Random(3)
    few = [1.0 + rng.gauss(0, 1) for _ in range(20)]
    many = [1.0 + rng.gauss(0, 1) for _ in range(2000)]
    low, high = paired_bootstrap(few)
    assert low < sum(few) / len(few) < high
    many_low, many_high = paired_bootstrap(many)
    assert many_low < 1.0 < many_high and many_high - many_low < (high - low) / 4
    assert paired_bootstrap([0.2] * 10) == (pytest.approx(0.2), pytest.approx(0.2))
    assert all(math.isnan(bound) for bound in paired_bootstrap([]))


def test_chronological_order_sorts_facts_by_their_source_turn() -> None:
    facts = [pb.RetrievedFact(fact_id="late", rank=0), pb.RetrievedFact(fact_id="early", rank=1)]
    key = order_key("chronological", {"early": 3, "late": 9})
    assert [f.fact_id for f in sorted(facts, key=key)] == ["early", "late"]


def _row(variant: str, question_id: str, category: int, text_nll: float, kv_nll: float, recall5: float | None,
         kv_f1: float = 0.0) -> dict:
    return {"variant": variant, "question_id": question_id, "category": category, "text_nll": text_nll,
            "kv_nll": kv_nll, "text_f1": 1.0, "kv_f1": kv_f1,
            "recall": {"5": recall5, "10": recall5, "20": recall5, "50": recall5}}


def test_summary_gap_is_kv_minus_text_per_category_and_overall() -> None:
    rows = [_row("w=0", "a", 1, 1.0, 1.5, 1.0), _row("w=0", "b", 1, 2.0, 1.9, None),
            _row("w=0", "c", 4, 1.0, 1.2, 0.0, kv_f1=1.0), _row("w=5", "a", 1, 1.0, 1.0, 1.0)]
    summary = summarize(rows, [Variant("w=0", 0), Variant("w=5", 5)])
    multi_hop, overall = summary["w=0"]["1"], summary["w=0"]["overall"]
    assert multi_hop["questions"] == 2
    assert multi_hop["gap"] == pytest.approx((0.5 - 0.1) / 2)
    assert multi_hop["gap_ci"][0] <= multi_hop["gap"] <= multi_hop["gap_ci"][1]
    assert multi_hop["gap_ci"][0] >= -0.1 - 1e-9 and multi_hop["gap_ci"][1] <= 0.5 + 1e-9
    assert multi_hop["recall"]["5"] == 1.0  # the question without evidence is left out, not counted as 0
    assert overall["gap"] == pytest.approx((0.5 - 0.1 + 0.2) / 3)
    assert overall["kv_f1"] == pytest.approx(1 / 3) and overall["f1_gap"] == pytest.approx(-2 / 3)
    assert summary["w=5"]["overall"]["gap"] == 0.0
    assert summary["w=5"]["2"]["questions"] == 0 and math.isnan(summary["w=5"]["2"]["gap"])


def test_result_cache_resumes_the_rows_of_an_interrupted_run(tmp_path) -> None:
    path = tmp_path / "per_question.jsonl"
    first = ResultCache(path)
    first.put(_row("w=0", "a", 1, 1.0, 1.5, 1.0))
    first.put(_row("w=5", "a", 1, 1.0, 1.1, 1.0))
    resumed = ResultCache(path)
    row = resumed.get("w=5", "a")
    assert row is not None and row["kv_nll"] == 1.1
    assert resumed.get("w=20", "a") is None
    assert len(resumed.rows) == 2


def test_report_gives_each_variants_differences_with_intervals_and_marks_empty_categories() -> None:
    rows = [_row("w=0", "a", 1, 1.0, 1.4, 1.0), _row("w=5", "a", 1, 1.0, 1.1, 1.0)]
    result = {"summary": summarize(rows, [Variant("w=0", 0), Variant("w=5", 5)]), "model": "m", "k": 50,
              "conversations": ["conv-a"], "rows": 2}
    report = markdown_report(result, ["out/fidelity_gap.png"])
    assert ("| w=5 | 1 | 1.000 | 1.100 | 0.100 [0.100, 0.100] | 1.000 | 0.000 | -1.000 [-1.000, -1.000] |"
            in report)
    assert ("| w=0 | 0.400 [0.40, 0.40] | n/a [n/a, n/a] | n/a [n/a, n/a] | n/a [n/a, n/a] | 0.400 [0.40, 0.40] |"
            in report)
    assert "![fidelity_gap](fidelity_gap.png)" in report


def test_recall_per_mode_compares_each_mode_with_the_first_on_the_same_questions() -> None:
    def row(mode: str, question: str, category: int, at_20: float) -> dict:
        return {"mode": mode, "question_id": question, "category": category, "recall": {"20": at_20, "50": 1.0},
                "ceiling": 1.0 if category == 1 else 0.5}

    rows = [row("vector", "q1", 1, 0.5), row("vector", "q2", 2, 1.0),
            row("hybrid", "q1", 1, 1.0), row("hybrid", "q2", 2, 1.0)]
    summary = summarize_recall(rows, ["vector", "hybrid"], (20, 50))
    assert summary["hybrid"]["overall"]["recall"] == {"20": 1.0, "50": 1.0}
    assert summary["hybrid"]["1"]["vs_first@20"] == (0.5, (0.5, 0.5))
    assert summary["hybrid"]["2"]["vs_first@20"][0] == 0.0 and summary["vector"]["1"]["recall"]["20"] == 0.5
    report = recall_report(summary, ["vector", "hybrid"], (20, 50), ["conv-a"])
    assert "| hybrid | 1 multi-hop | 1 | 1.000 | 1.000 | 0.500 [0.500, 0.500] | 0.000 [0.000, 0.000] |" in report


def test_recall_per_mode_reports_the_ceiling_beside_recall_per_category() -> None:
    rows = [{"mode": mode, "question_id": question, "category": category, "recall": {"20": 0.5, "50": 0.5},
             "ceiling": ceiling}
            for mode in ("vector", "hybrid") for question, category, ceiling in (("q1", 1, 1.0), ("q2", 1, 0.5),
                                                                                 ("q3", 2, 0.0))]
    summary = summarize_recall(rows, ["vector", "hybrid"], (20, 50))
    assert summary["hybrid"]["1"]["ceiling"] == 0.75 and summary["hybrid"]["overall"]["ceiling"] == 0.5
    report = recall_report(summary, ["vector", "hybrid"], (20, 50), ["conv-a"], "turns")
    assert "facts: turns" in report
    assert ("| hybrid | 1 multi-hop | 2 | 0.500 | 0.500 | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] | 0.750 |"
            in report)


def test_quality_summary_reports_the_ceiling_and_leaves_rows_cached_without_it_out() -> None:
    rows = [_row("w=0", "a", 1, 1.0, 1.0, 1.0) | {"ceiling": 0.5}, _row("w=0", "b", 1, 1.0, 1.0, 1.0)]
    summary = summarize(rows, [Variant("w=0", 0)])
    assert summary["w=0"]["1"]["ceiling"] == 0.5
    report = markdown_report({"summary": summary, "model": "m", "k": 50, "conversations": ["conv-a"], "rows": 2,
                              "facts": "turns"}, [])
    assert "facts: turns" in report and "| 1 multi-hop | 2 | 1.00 | 1.00 | 1.00 | 1.00 | 0.50 |" in report
