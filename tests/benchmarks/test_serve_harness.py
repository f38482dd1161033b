"""The serving benchmark's own logic: hit rates from counter deltas, connector phases, the speed-run model folder."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from benchmarks.dummy_model import build_dummy_model
from benchmarks.serve import (
    cold_jobs,
    cold_node_cache_mb,
    connector_deltas,
    connector_phases,
    engine_ttft_ms,
    engine_ttft_percentile_ms,
    hit_rate,
    measured_contenders,
    parse_counters,
    report,
)
from benchmarks.serve_requests import (
    Sample,
    arrival_offsets,
    locomo_workload,
    memory_lost,
    summarize,
    synthetic_workload,
)
from benchmarks.synthetic_worker import SyntheticFactEncoder
from inferscale_kv.model_profile import build_model_profile
from precompute_worker.encoder import EncodingGroup, FactKey, FactSpec


def test_hit_rate_is_the_ratio_of_counter_deltas_and_none_without_lookups() -> None:
    before = {"node_cache_hits": 10, "node_cache_lookups": 20}
    assert hit_rate(before, {"node_cache_hits": 13, "node_cache_lookups": 24}) == 0.75
    assert hit_rate(before, before) is None


def test_connector_phases_take_only_warm_loads_of_the_requested_size(tmp_path) -> None:
    loads = [{"chunks": 11, "node_cache_misses": 0, "tokens": 200, "ms": 2.0, "stage_ms": 0.2, "compose_ms": 1.0,
              "write_ms": 0.8},
             {"chunks": 11, "node_cache_misses": 3, "tokens": 200, "ms": 9.0, "stage_ms": 7.0, "compose_ms": 1.0,
              "write_ms": 1.0},
             {"chunks": 51, "node_cache_misses": 0, "tokens": 900, "ms": 3.0, "stage_ms": 0.4, "compose_ms": 1.4,
              "write_ms": 1.2}]
    path = tmp_path / "loads.jsonl"
    path.write_text("".join(json.dumps(load) + "\n" for load in loads))
    assert connector_phases(path, 11) == {"loads": 1, "tokens_p50": 200, "ms_p50": 2.0, "stage_ms_p50": 0.2,
                                          "compose_ms_p50": 1.0, "write_ms_p50": 0.8}
    assert connector_phases(path, 21) is None
    assert connector_phases(tmp_path / "absent.jsonl", 11) is None


def test_dummy_model_folder_has_the_shape_a_real_tokenizer_and_a_profile(tiny_llama_dir, tmp_path) -> None:
    folder = build_dummy_model(tmp_path / "tiny", "llama-tiny", tiny_llama_dir, "bfloat16")
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (4, 2, len(tokenizer))
    assert build_model_profile(folder, tokenizer, "bfloat16", 0).profile_id.startswith("kvp-")


def test_synthetic_encoder_gives_every_fact_kv_of_the_model_shape(tiny_llama_dir, tmp_path) -> None:
    folder = build_dummy_model(tmp_path / "tiny", "llama-tiny", tiny_llama_dir, "bfloat16")
    encoder = SyntheticFactEncoder(AutoConfig.from_pretrained(folder), torch.bfloat16, 2048)
    specs = [FactSpec(FactKey("u", f"f{i}", 1), list(range(3 + i)), 0) for i in range(3)]
    encoded = encoder.encode([EncodingGroup([1, 2], specs[:2]), EncodingGroup([], specs[2:])])
    assert [fact.spec for fact in encoded] == specs
    assert [tuple(fact.keys.shape) for fact in encoded] == [(4, 3 + i, 2, 64) for i in range(3)]
    assert all(fact.values.dtype == torch.bfloat16 for fact in encoded)


def test_synthetic_workers_agree_on_each_facts_kv_and_differ_between_facts(tiny_llama_dir, tmp_path) -> None:
    """Two synthetic workers (a prepare resumed starts a second) compute the same KV for the same fact, header
    included, as real workers do: otherwise the service's header check and KV audit withdraw it."""
    folder = build_dummy_model(tmp_path / "tiny", "llama-tiny", tiny_llama_dir, "bfloat16")
    first, second = (SyntheticFactEncoder(AutoConfig.from_pretrained(folder), torch.bfloat16, 2048) for _ in range(2))
    specs = [FactSpec(FactKey("u", "f0", 1), [5, 6, 7], 2), FactSpec(FactKey("u", "f1", 1), [5, 6, 8], 2)]
    groups = [EncodingGroup([1, 2, 3], specs)]
    second.encode([EncodingGroup([1, 2, 3], specs[1:])])  # the second worker has computed other facts before
    again = second.encode([EncodingGroup([1, 2, 3], specs[:1])])[0]
    one, other = first.encode(groups)
    assert torch.equal(one.keys, again.keys) and torch.equal(one.values, again.values)
    assert not torch.equal(one.keys, other.keys) and not torch.equal(one.keys, one.values)
    elsewhere = first.encode([EncodingGroup([1, 9, 3], specs[:1])])[0]  # another context before the fact
    assert not torch.equal(one.keys, elsewhere.keys)


METRICS_TEXT = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.75
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 1.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 9.0
inferscale_connector_node_cache_hits_total{engine="0",model_name="m"} 4.0
inferscale_connector_node_cache_hits_total{engine="1",model_name="m"} 2.0
inferscale_connector_loads_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 40.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


def test_counters_sum_label_sets_and_take_vllm_ttft_queue_and_prefill_sums_and_counts_only() -> None:
    assert parse_counters(METRICS_TEXT) == {"ttft_sum": 0.75, "ttft_count": 3.0, "queue_sum": 0.25,
                                            "queue_count": 3.0, "prefill_sum": 0.5, "prefill_count": 3.0,
                                            "node_cache_hits": 6.0, "prefix_cache_queries": 40.0,
                                            "prefix_cache_hits": 30.0, "ttft_le:0.01": 1.0}


def test_engine_ttft_is_the_mean_of_the_histogram_delta_and_nan_without_requests() -> None:
    before, after = {"ttft_sum": 1.0, "ttft_count": 2.0}, {"ttft_sum": 1.5, "ttft_count": 12.0}
    assert engine_ttft_ms(before, after) == {"mean": 50.0, "requests": 10.0}
    assert math.isnan(engine_ttft_ms(after, after)["mean"])
    queue = engine_ttft_ms({"queue_sum": 0.1, "queue_count": 1.0}, {"queue_sum": 0.3, "queue_count": 5.0}, "queue")
    assert queue == {"mean": pytest.approx(50.0), "requests": 4.0}


def test_open_loop_arrivals_start_at_zero_increase_and_average_the_requested_rate() -> None:
    offsets = arrival_offsets(4000, 20.0, random.Random(1))
    assert offsets[0] == 0.0 and all(b > a for a, b in zip(offsets, offsets[1:], strict=False))
    assert abs(len(offsets) / offsets[-1] - 20.0) < 1.5


def test_synthetic_workload_gives_each_user_distinct_facts_and_jobs_round_robin_over_users() -> None:
    workload = synthetic_workload(3, 10, clauses=2)
    texts = [fact.text for user in workload.users for fact in workload.facts[user]]
    assert len(texts) == 30 and len(set(texts)) == 30 and all(", and " in text for text in texts)
    jobs = workload.jobs(7, random.Random(0))
    assert [user for user, _ in jobs] == [workload.users[i % 3] for i in range(7)]
    assert all(question in workload.questions[user] for user, question in jobs)


def test_locomo_workload_replays_conversations_round_robin_with_their_first_facts(locomo_file) -> None:
    workload = locomo_workload(locomo_file, 3, 2)
    assert len(workload.users) == 3 and len(set(workload.users)) == 3
    first, second, third = (workload.facts[user] for user in workload.users)
    assert [f.text for f in first] == [f.text for f in third] != [f.text for f in second]
    assert len(first) == 2 and workload.turns[workload.users[0]]
    assert workload.questions[workload.users[1]] == ["What did Bo adopt?", "When did Ana start pottery?"]


def _row(scale: float, hit_rate: float | None = None, fetched: float = 0.0) -> dict:
    latency = {"p50": 10.0 * scale, "p90": 12.0 * scale, "p99": 13.0 * scale, "mean": 11.0 * scale}
    return {"requests": 4, "query_to_first_token_ms": latency, "ttft_ms": latency, "tpot_ms": latency,
            "engine_ttft_ms": {"mean": 8.0 * scale}, "engine_queue_ms": {"mean": 2.0 * scale},
            "engine_prefill_ms": {"mean": 5.0 * scale}, "throughput_rps": 1.0 / scale, "mean_prompt_tokens": 100,
            "mean_cached_tokens": 90 if scale == 1 else 0, "node_cache_hit_rate": hit_rate,
            "prefix_cache_hit_rate": 0.5, "facts_fetched_per_request": fetched}


def test_report_prints_every_contender_and_kvs_ratios_to_text_and_text_stable(capsys) -> None:
    report({"kv": {"50": _row(1, 1.0)}, "text": {"50": _row(4)}, "text-stable": {"50": _row(2)},
            "off": {"50": _row(0.5)}, "kv-tail2": {"50": _row(1.1, 1.0)}}, "test")
    out = capsys.readouterr().out
    assert "k = 50 facts" in out and "Request throughput (req/s)" in out and "Prefix-cache hit rate" in out
    assert "kv/text: query-to-first-token p50 0.25" in out and "engine TTFT (vLLM mean) 0.25" in out
    assert "throughput 4.00x" in out
    assert "kv/text-stable: query-to-first-token p50 0.50" in out and "throughput 2.00x" in out
    assert "kv-tail2: engine TTFT 8.8 ms, +10.0% over kv" in out
    assert "Engine queue time, vLLM mean (ms)" in out and "Engine prefill time, vLLM mean (ms)" in out
    assert "kv - off: engine TTFT +4.0 ms = queue +1.0 + prefill +2.5 + rest +0.5" in out


def test_report_of_a_cold_node_cache_prices_a_miss_against_the_warm_users(capsys) -> None:
    report({"kv": {"20": _row(3, 0.25, fetched=15.0)}, "text": {"20": _row(4)}, "kv-warm": {"20": _row(1, 1.0)}},
           "cold", node_cache_mb=96)
    out = capsys.readouterr().out
    assert "cold node cache (96 MiB): miss rate 0.75, 15.0 facts fetched per request" in out
    assert "+20.0 ms against the warm users (1.33 ms per fetched fact)" in out


def test_jobs_do_not_repeat_a_users_question_until_its_questions_run_out() -> None:
    workload = synthetic_workload(2, 5, clauses=1)
    jobs = workload.jobs(64, random.Random(0))
    per_user = {user: [q for u, q in jobs if u == user] for user in workload.users}
    assert all(len(set(asked[:32])) == 32 for asked in per_user.values())  # 32 questions each
    assert {user for user, _ in workload.jobs(4, random.Random(0), users=workload.users[1:])} == {workload.users[1]}
    warm = workload.warm_up_questions(workload.users[0], 10, seed=3)
    assert len(warm) == 10 and not set(warm) & set(workload.questions[workload.users[0]])


def test_the_cold_node_cache_holds_one_and_a_half_times_the_warm_users_kv(tiny_llama_dir) -> None:
    workload = synthetic_workload(4, 10, clauses=1)
    one = cold_node_cache_mb(tiny_llama_dir, "float32", workload, 1)
    assert one >= 1 and cold_node_cache_mb(tiny_llama_dir, "float32", workload, 4) >= 3 * one


KV = {"mode": "kv", "recompute_tail_facts": 0, "kv_crossover_tokens": 0}


@pytest.mark.parametrize(("summary", "memory", "why"), [
    ({"mode": "kv", "facts": 20, "kv_facts": 20, "injectable_tokens": 700}, KV, None),
    ({"mode": "kv", "memory": "dropped", "reason": "deadline", "error": "memory service: DEADLINE_EXCEEDED",
      "facts": 0}, KV, "memory service: DEADLINE_EXCEEDED"),
    ({"mode": "text", "facts": 12}, {"mode": "text"}, "12 of 20 facts"),
    ({"mode": "kv", "facts": 20, "kv_facts": 0, "header_kv": "missing"}, KV, "no header KV: nothing injected"),
    ({"mode": "kv", "facts": 20, "kv_facts": 15}, KV, "15 of 20 facts injected"),
    ({"mode": "kv", "facts": 20, "kv_facts": 18}, {**KV, "recompute_tail_facts": 2}, None),
    ({"mode": "kv", "facts": 20, "kv_facts": 0, "served_as": "text"}, {"mode": "kv"}, None),  # kv-auto, crossover
    ({"mode": "off"}, {"mode": "off"}, None),
])
def test_a_request_without_the_memory_its_contender_asked_for_is_named(summary, memory, why) -> None:
    assert memory_lost(summary, memory, expected_facts=20) == why


def test_a_kv_request_the_connector_left_to_prefill_is_not_a_kv_result() -> None:
    summary = {"mode": "kv", "facts": 20, "kv_facts": 20, "injectable_tokens": 700}
    assert memory_lost(summary, KV, 20, cached_tokens=704) is None
    assert memory_lost(summary, KV, 20, cached_tokens=0) == "0 of 700 injectable tokens loaded (prefilled instead)"


def test_requests_that_lost_their_memory_are_counted_apart_and_never_in_the_figures() -> None:
    def sample(seconds: float, lost: str | None) -> Sample:
        return Sample("kv", 20, seconds, seconds, 0.01, seconds + 0.1, 700 if lost is None else 40, 0, lost)

    row = summarize([sample(0.05, None), sample(0.07, None), sample(2.0, "memory service: DEADLINE_EXCEEDED")], 1.0)
    assert (row["requests"], row["lost_memory"]) == (2, 1)
    assert row["lost_memory_examples"] == ["memory service: DEADLINE_EXCEEDED"]
    assert row["query_to_first_token_ms"]["p99"] < 100 and row["mean_prompt_tokens"] == 700
    assert math.isnan(row["throughput_rps"])  # it covers every request: withheld


def test_no_ratio_is_drawn_from_a_row_whose_requests_lost_their_memory(capsys) -> None:
    lost = {**_row(0.5, 1.0), "lost_memory": 3, "lost_memory_examples": ["memory service: DEADLINE_EXCEEDED"]}
    report({"kv": {"50": lost}, "text": {"50": _row(4)}, "off": {"50": _row(0.5)}}, "test")
    out = capsys.readouterr().out
    assert "kv/text: n/a (requests lost their memory: not a result)" in out
    assert "kv/text: query-to-first-token" not in out and "kv - off:" not in out
    assert "Requests that lost their memory" in out


def test_engine_ttft_p50_is_interpolated_inside_the_bucket_of_the_runs_delta() -> None:
    before = {"ttft_le:0.01": 5.0, "ttft_le:0.02": 5.0, "ttft_le:0.04": 5.0, "ttft_le:+Inf": 5.0}
    # this run: 2 requests under 10 ms, 6 in (10, 20], 2 in (20, 40]: the 5th of 10 lies 3/6 into (10, 20]
    after = {"ttft_le:0.01": 7.0, "ttft_le:0.02": 13.0, "ttft_le:0.04": 15.0, "ttft_le:+Inf": 15.0}
    assert engine_ttft_percentile_ms(before, after) == pytest.approx(15.0)
    assert engine_ttft_percentile_ms(before, after, 0.9) == pytest.approx(30.0)
    assert math.isnan(engine_ttft_percentile_ms(after, after))
    beyond = {**after, "ttft_le:+Inf": 25.0}  # most of this run past the last finite bound: that bound
    assert engine_ttft_percentile_ms(before, beyond, 0.9) == pytest.approx(40.0)


def test_connector_deltas_give_each_counters_change_and_the_node_measured_bandwidths() -> None:
    before = {"partial_loads": 2, "source_bytes_fetched": 1e9, "source_fetch_micros": 1e6}
    after = {"partial_loads": 5, "async_loads": 1, "warmed_chunks": 30, "source_bytes_fetched": 3e9,
             "source_fetch_micros": 2e6, "host_bytes_copied": 4e8, "host_copy_micros": 2e4}
    deltas = connector_deltas(before, after)
    assert (deltas["partial_loads"], deltas["async_loads"], deltas["warmed_chunks"], deltas["load_failures"]) == (
        3, 1, 30, 0)
    assert deltas["source_gbps"] == pytest.approx(2.0) and deltas["host_gbps"] == pytest.approx(20.0)
    assert connector_deltas(after, after)["source_gbps"] is None


def test_cold_jobs_ask_each_user_once_and_no_user_at_two_loads() -> None:
    from benchmarks.serve import WorkloadPlan

    workload = synthetic_workload(6, 3, clauses=1)
    plan = WorkloadPlan("cold", workload, [2], warm_users=workload.users[:2])
    rng = random.Random(0)
    first, second = (cold_jobs(plan, 3, index, 2, rng) for index in range(2))
    users = [user for user, _ in first + second]
    assert len(users) == len(set(users)) == 6
    with pytest.raises(SystemExit, match="ask 8 users the node has not seen; the workload has 6"):
        cold_jobs(plan, 4, 0, 2, rng)


def test_a_users_second_question_is_another_of_its_questions() -> None:
    workload = synthetic_workload(3, 3, clauses=1)
    jobs = workload.jobs(3, random.Random(0))
    seconds = workload.second_questions(jobs, random.Random(1))
    assert [user for user, _ in seconds] == [user for user, _ in jobs]
    assert all(q2 != q1 and q2 in workload.questions[user] for (user, q1), (_, q2) in zip(jobs, seconds, strict=True))


def test_measured_contenders_keep_the_runs_order_and_refuse_unknown_names() -> None:
    contenders = {"kv": {}, "text": {}, "text-stable": {}, "off": {}, "kv-auto": {}}
    assert list(measured_contenders(contenders, ["off", "kv"])) == ["kv", "off"]
    assert measured_contenders(contenders, None) is contenders
    with pytest.raises(SystemExit, match="kv-host not in this run"):
        measured_contenders(contenders, ["kv-host"])


def test_a_kv_request_the_miss_policy_prefilled_counts_apart_when_the_run_allows_it() -> None:
    from benchmarks.serve_requests import prefilled_instead

    summary = {"mode": "kv", "facts": 20, "kv_facts": 20, "injectable_tokens": 700}
    assert memory_lost(summary, KV, 20, cached_tokens=96, prefilled_ok=True) is None
    assert prefilled_instead(summary, KV, 96) and not prefilled_instead(summary, KV, 704)
    assert not prefilled_instead({**summary, "served_as": "text"}, {"mode": "kv"}, 0)  # kv-auto's crossover
    assert not prefilled_instead(summary, {"mode": "text"}, 0)


def test_report_gives_the_issues_ratios_differences_and_connector_deltas(capsys) -> None:
    def with_engine(row: dict, p50: float, **connector: float) -> dict:
        return {**row, "engine_ttft_ms": {**row["engine_ttft_ms"], "p50": p50},
                "connector": {"source_gbps": None, "host_gbps": None, **connector}, "prefilled": 0}

    rows = {"kv": with_engine(_row(3), 20.0, partial_loads=4, facts_fetched=80, source_bytes_fetched=2e9,
                              source_fetch_micros=1e6, source_gbps=2.0),
            "text": with_engine(_row(2), 16.0), "off": with_engine(_row(1), 8.0),
            "kv-auto": with_engine(_row(2), 15.0, partial_loads=16),
            "kv-host": with_engine(_row(1.25), 10.0, host_tier_hits=60, host_gbps=25.0),
            "kv-second": with_engine(_row(1.5), 11.0, warmed_chunks=0)}
    report({name: {"20": row} for name, row in rows.items()}, "cold", node_cache_mb=96)
    out = capsys.readouterr().out
    assert "engine TTFT kv/text: mean 1.50, p50 1.25" in out
    assert "engine TTFT kv-auto/text: mean 1.00, p50 0.94" in out
    assert "engine TTFT kv-host - off: mean +2.0 ms, p50 +2.0 ms" in out
    assert "engine TTFT kv-second - off: mean +4.0 ms, p50 +3.0 ms" in out
    assert "byte path (node's measure, kv and kv-auto's fetches): 2.00 GB/s" in out
    partial = next(line for line in out.splitlines() if line.startswith("Connector: partial loads"))
    assert partial.split()[3:] == ["4", "16"]  # kv's and kv-auto's: the columns without any stay empty
    assert "Host tier to device (GB/s)" in out and "25.00" in out
