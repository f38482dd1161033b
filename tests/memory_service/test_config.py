import os
import subprocess
import sys
from pathlib import Path

import pytest

from memory_service.config import ConfigError, Limits, ServiceConfig, build_parser, load_config
from precompute_worker.__main__ import build_parser as worker_parser
from tests.inferscale_kv.published_flags import assert_each_flag_reads_its_variable, flag_defaults

# Every flag and its default, as operators' manifests and scripts know them (each also INFERSCALE_<FLAG>).
PUBLISHED_FLAGS = {
    "--data-dir": None, "--host": "0.0.0.0", "--port": 50051, "--metrics-port": 9400,
    "--embedding-model": "all-MiniLM-L6-v2", "--embedding-device": "cpu", "--embedding-backend": "onnx",
    "--embedding-cache-dir": None, "--embedding-batch-size": 64, "--embedding-threads": 1,
    "--max-message-bytes": 64 * 1024 * 1024, "--shutdown-grace-s": 5.0, "--kv-host-budget-mb": 1024,
    "--kv-gpu-budget-mb": 0, "--kv-disk-budget-gb": 100.0, "--kv-lease-seconds": 120, "--kv-lease-max-seconds": 600,
    "--kv-lease-max-facts": 64,
    "--kv-max-attempts": 3, "--kv-audit-share": 0.05,
    "--retrieval-mode": "hybrid", "--search-cache-mb": 256, "--lancedb-cache-mb": 128, "--optimize-interval-s": 300.0,
    "--optimize-after-writes": 1000, "--auth-file": None, "--user-token-public-key-file": None,
    "--user-token-issuer": "", "--user-token-audience": "inferscale-memory", "--user-token-max-lifetime-s": 300.0,
    "--tls-cert-file": None,
    "--tls-key-file": None,
    "--tls-client-ca-file": None, "--health-port": 0, "--log-level": "info", "--coordination-url": "",
    "--store-uri": "", "--s3-endpoint": "", "--s3-region": "us-east-1", "--s3-allow-http": False,
    "--tier-sweep-interval-s": 10.0,
    "--max-facts-per-call": 1000, "--max-turns-per-call": 10_000, "--max-fact-chars": 2000, "--max-turn-chars": 20_000,
    "--max-query-chars": 2000, "--max-top-k": 1000, "--default-top-k": 10, "--max-page-size": 1000,
    "--default-page-size": 100, "--max-metadata-entries": 32, "--max-metadata-value-chars": 1024,
    "--max-delete-ids": 10_000, "--max-facts-per-user": 100_000,
}


def test_environment_supplies_defaults_and_flags_override_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_DATA_DIR", "/tmp/from-env")
    monkeypatch.setenv("INFERSCALE_PORT", "6000")
    monkeypatch.setenv("INFERSCALE_MAX_TOP_K", "77")
    config = load_config(["--port", "7000"])
    assert config.data_dir == Path("/tmp/from-env")
    assert config.port == 7000
    assert config.limits.max_top_k == 77


def test_missing_data_dir_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERSCALE_DATA_DIR", raising=False)
    with pytest.raises(ConfigError, match="--data-dir"):
        load_config([])


def test_out_of_range_port_error_names_the_flag() -> None:
    with pytest.raises(ConfigError, match="--port"):
        load_config(["--data-dir", "/tmp/x", "--port", "70000"])


def test_default_top_k_above_max_top_k_is_rejected() -> None:
    with pytest.raises(ConfigError, match="--default-top-k"):
        load_config(["--data-dir", "/tmp/x", "--default-top-k", "50", "--max-top-k", "20"])


def test_a_default_lease_longer_than_the_longest_is_refused() -> None:
    with pytest.raises(ConfigError, match="--kv-lease-seconds"):
        load_config(["--data-dir", "/tmp/x", "--kv-lease-seconds", "700", "--kv-lease-max-seconds", "600"])


def test_the_workers_default_lease_is_within_the_services_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    worker_lease = flag_defaults(worker_parser, monkeypatch)["--lease-seconds"]
    assert isinstance(worker_lease, int)
    assert worker_lease <= ServiceConfig(data_dir=Path("/tmp/x")).kv_lease_max_seconds


def test_help_lists_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "memory_service", "--help"], capture_output=True, text=True, check=True
    )
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert option in result.stdout
    assert "--max-facts-per-call" in result.stdout
    assert len(Limits.__dataclass_fields__) > 5


def test_invalid_config_exits_with_status_2_and_a_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "memory_service", "--data-dir", "/tmp/x", "--log-level", "loud"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "--log-level" in result.stderr


def test_the_onnx_embedding_backend_on_a_gpu_device_is_refused_pointing_at_torch() -> None:
    with pytest.raises(ConfigError, match="--embedding-backend torch"):
        load_config(["--data-dir", "/tmp/x", "--embedding-device", "cuda"])
    assert load_config(["--data-dir", "/tmp/x", "--embedding-device", "cuda", "--embedding-backend", "torch"])


def test_an_unknown_embedding_backend_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="onnx, torch"):
        load_config(["--data-dir", "/tmp/x", "--embedding-backend", "openvino"])


def test_the_embedding_cache_defaults_into_the_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERSCALE_EMBEDDING_CACHE_DIR", raising=False)
    assert load_config(["--data-dir", "/tmp/x"]).resolved_embedding_cache_dir == Path("/tmp/x/embedding-onnx")
    assert load_config(["--data-dir", "/tmp/x", "--embedding-cache-dir", "/tmp/c"]).resolved_embedding_cache_dir \
        == Path("/tmp/c")


def test_a_non_positive_optimize_interval_is_refused() -> None:
    with pytest.raises(ConfigError, match="--optimize-interval-s"):
        load_config(["--data-dir", "/tmp/x", "--optimize-interval-s", "0"])


def test_the_flags_and_their_defaults_are_the_published_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    assert flag_defaults(build_parser, monkeypatch) == PUBLISHED_FLAGS


def test_every_flag_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_each_flag_reads_its_variable(build_parser, monkeypatch, samples={"--retrieval-mode": "keyword"})


def test_the_parsed_defaults_are_the_configs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_DATA_DIR", "/tmp/x")
    assert load_config([]) == ServiceConfig(data_dir=Path("/tmp/x"))


def test_every_flag_and_variable_reaches_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_S3_ALLOW_HTTP", "yes")
    monkeypatch.setenv("INFERSCALE_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("INFERSCALE_AUTH_FILE", "")
    config = load_config(["--data-dir", "/tmp/x", "--embedding-cache-dir", "/tmp/c", "--kv-disk-budget-gb", "2.5",
                          "--max-facts-per-user", "5", "--coordination-url", "postgresql://u:p@h/db",
                          "--store-uri", "s3://bucket/prefix"])
    assert config == ServiceConfig(
        data_dir=Path("/tmp/x"), embedding_cache_dir=Path("/tmp/c"), kv_disk_budget_gb=2.5,
        limits=Limits(max_facts_per_user=5), coordination_url="postgresql://u:p@h/db", store_uri="s3://bucket/prefix",
        s3_allow_http=True, log_level="debug", auth_file=None)


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("INFERSCALE_PORT", "http", "argument --port: INFERSCALE_PORT: 'http' is not an integer"),
    ("INFERSCALE_MAX_TOP_K", "lots", "argument --max-top-k: INFERSCALE_MAX_TOP_K: 'lots' is not an integer"),
    ("INFERSCALE_S3_ALLOW_HTTP", "maybe", "argument --s3-allow-http: INFERSCALE_S3_ALLOW_HTTP: 'maybe' is not one of"),
])
def test_a_bad_variable_is_a_usage_error_naming_the_flag_and_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str,
        message: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        load_config(["--data-dir", "/tmp/x"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_variable_exits_the_service_with_status_2_and_no_traceback() -> None:
    result = subprocess.run([sys.executable, "-m", "memory_service", "--data-dir", "/tmp/x"],
                            env={**os.environ, "INFERSCALE_KV_DISK_BUDGET_GB": "much"}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "argument --kv-disk-budget-gb: INFERSCALE_KV_DISK_BUDGET_GB: 'much' is not a number" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_gives_each_flag_its_variable_and_default() -> None:
    result = subprocess.run([sys.executable, "-m", "memory_service", "--help"], capture_output=True, text=True,
                            check=True)
    text = " ".join(result.stdout.split())
    for flag in PUBLISHED_FLAGS:
        assert f"{flag} " in text and f"(INFERSCALE_{flag[2:].replace('-', '_').upper()}" in text, flag
    assert "--port PORT gRPC port (INFERSCALE_PORT; default: 50051)" in text
