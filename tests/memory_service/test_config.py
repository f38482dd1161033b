import subprocess
import sys
from pathlib import Path

import pytest

from memory_service.config import ConfigError, Limits, build_parser, load_config


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
