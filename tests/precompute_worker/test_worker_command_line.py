"""`python -m precompute_worker`'s flags and INFERSCALE_WORKER_* variables: the published ones, read and checked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from precompute_worker.__main__ import WorkerOptions, build_parser, main
from tests.inferscale_kv.published_flags import assert_each_flag_reads_its_variable, flag_defaults

# Every flag and its default but --worker-id's (<host>-<pid>), as operators' manifests and scripts know them.
PUBLISHED_FLAGS = {
    "--memory-service": "127.0.0.1:50051", "--model": None, "--model-name": None, "--dtype": "float32",
    "--kv-dtype": None, "--context-window": 50, "--device": "cpu", "--max-facts": 64, "--lease-seconds": 120,
    "--max-tokens-per-forward": 2048, "--encoding": "shared", "--poll-interval-s": 1.0, "--exit-when-idle": False,
    "--threads": 0, "--log-level": "info",
}


def test_the_flags_and_their_defaults_are_the_published_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = flag_defaults(build_parser, monkeypatch)
    assert flags.pop("--worker-id") == f"{socket.gethostname()}-{os.getpid()}"
    assert flags == PUBLISHED_FLAGS


def test_every_flag_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_each_flag_reads_its_variable(build_parser, monkeypatch, samples={
        "--dtype": "bfloat16", "--kv-dtype": "fp8_e4m3", "--encoding": "naive", "--worker-id": "worker-7"})


def test_flags_and_variables_build_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERSCALE_WORKER_DTYPE", "bfloat16")
    monkeypatch.setenv("INFERSCALE_WORKER_EXIT_WHEN_IDLE", "1")
    parser = build_parser()
    options = parser.build(WorkerOptions, parser.parse_args(["--model", "/m", "--max-facts", "8", "--dtype",
                                                             "float16", "--worker-id", "w"]))
    assert options == WorkerOptions(model="/m", max_facts=8, dtype="float16", worker_id="w", exit_when_idle=True)


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("INFERSCALE_WORKER_MAX_FACTS", "all",
     "argument --max-facts: INFERSCALE_WORKER_MAX_FACTS: 'all' is not an integer"),
    ("INFERSCALE_WORKER_KV_DTYPE", "int4", "argument --kv-dtype: INFERSCALE_WORKER_KV_DTYPE: 'int4' is not one of"),
])
def test_a_bad_variable_is_a_usage_error_naming_the_flag_and_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str,
        message: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "/nonexistent"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_model_and_a_bad_context_window_are_refused_naming_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "absent")]) == 2
    assert "--model:" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--context-window", "-2"]) == 2
    assert "--context-window:" in capsys.readouterr().err


def test_help_lists_every_flag_with_its_variable() -> None:
    result = subprocess.run([sys.executable, "-m", "precompute_worker", "--help"], capture_output=True, text=True,
                            check=True)
    text = " ".join(result.stdout.split())
    for flag in [*PUBLISHED_FLAGS, "--worker-id"]:
        assert f"{flag} " in text and f"(INFERSCALE_WORKER_{flag[2:].replace('-', '_').upper()}" in text, flag
