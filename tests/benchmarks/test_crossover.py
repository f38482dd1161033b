"""The kv crossover drawn from a serving run: where kv's engine TTFT falls below text's and stays there."""

from __future__ import annotations

import json

import pytest

from benchmarks.crossover import crossover, record


def _results(points: list[tuple[int, int, float, float]]) -> dict:
    """contender -> k -> row, from (k, injected tokens, kv ms, text ms)."""
    return {"kv": {str(k): {"mean_cached_tokens": tokens, "engine_ttft_ms": {"mean": kv}}
                   for k, tokens, kv, _ in points},
            "text": {str(k): {"mean_cached_tokens": 0, "engine_ttft_ms": {"mean": text}} for k, _, _, text in points}}


def test_the_crossover_is_the_memory_from_which_kv_stays_faster() -> None:
    tokens, measured = crossover(_results([(1, 60, 21.0, 19.0), (5, 190, 21.4, 20.3), (10, 358, 20.0, 20.5),
                                           (20, 701, 20.0, 30.5), (50, 1678, 24.6, 44.7)]))
    assert tokens == 358 and "k=5 (190 tokens): kv 21.4 / text 20.3 ms" in measured


def test_a_win_followed_by_a_loss_does_not_count() -> None:
    tokens, _ = crossover(_results([(5, 190, 19.0, 20.0), (10, 358, 22.1, 18.9), (50, 1678, 24.6, 44.7)]))
    assert tokens == 1678


def test_kv_faster_everywhere_is_zero_and_slower_everywhere_is_past_the_largest_memory() -> None:
    assert crossover(_results([(1, 60, 10.0, 19.0), (50, 1678, 12.0, 44.7)]))[0] == 0
    tokens, measured = crossover(_results([(1, 60, 30.0, 19.0), (50, 1678, 52.0, 44.7)]))
    assert tokens == 1679 and measured.startswith("kv slower than text at every k measured")
    with pytest.raises(ValueError):
        crossover({"kv": {"5": {}}, "text": {}})


def test_record_adds_the_key_and_keeps_the_others(tmp_path) -> None:
    table = tmp_path / "kv_crossover.json"
    table.write_text(json.dumps({"about": "a", "crossovers": {"other": {"tokens": 0, "measured": "m"}}}))
    record(table, "llama-32L:bfloat16:GPU", 358, "engine TTFT ...")
    data = json.loads(table.read_text())
    assert data["crossovers"]["other"] == {"tokens": 0, "measured": "m"}
    assert data["crossovers"]["llama-32L:bfloat16:GPU"]["tokens"] == 358
