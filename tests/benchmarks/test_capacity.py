"""The capacity model's arithmetic: per-call costs scale to the target rate, KV bytes follow the model shape."""

from __future__ import annotations

import json

import pytest

from benchmarks import capacity


def test_llama3_8b_fp8_kv_is_64_kib_per_token() -> None:
    assert capacity.kv_bytes_per_token(layers=32, kv_heads=8, head_dim=128, dtype_bytes=1) == 65_536


def test_measured_costs_scale_to_the_target_rate(tmp_path, monkeypatch, capsys) -> None:
    row = {"cpu_ms": 5.0, "statements": 2.0, "s3_requests": 0.5, "postgres_cpu_ms": 0.25, "object_store_cpu_ms": 1.0}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"costs": {capacity.SHARED_SETUP: {name: row for name in capacity.SCENARIOS}}}))
    monkeypatch.setattr("sys.argv", ["capacity", "--replicas-results", str(results), "--calls-per-s", "1000",
                                     "--facts", "1000", "--tokens-per-fact", "10", "--top-k", "4",
                                     "--kv-miss-rate", "0.5", "--cores-per-replica", "2",
                                     "--target-utilization", "0.5", "--postgres-cores", "4"])
    capacity.main()
    model = json.loads((tmp_path / "capacity.json").read_text())
    scenario = model["scenarios"][capacity.SCENARIOS[0]]
    assert scenario["service_cores"] == pytest.approx(5.0)  # 1,000 calls/s x 5 ms
    assert scenario["replicas"] == 5  # 5 cores at half of 2 cores each
    assert scenario["postgres_statements_per_s"] == pytest.approx(2000)
    assert scenario["postgres_max_calls_per_s"] == pytest.approx(4 * 0.5 * 1000 / 0.25)
    assert scenario["object_store_requests_per_s"] == pytest.approx(500)
    assert model["kv_bytes_per_fact"] == 655_360
    assert model["stored"]["fact_kv_bytes"] == pytest.approx(655_360_000)
    assert model["per_call_miss"] == {"kv_bytes": 4 * 655_360, "object_store_gets": 4}
    assert model["kv_misses"]["object_store_gets_per_s"] == pytest.approx(2000)
    assert "1,000 RetrieveAndStage calls/s" in capsys.readouterr().out
