"""Counts the servers a test session starts, by kind, and prints them after the durations: the suite's time goes
mostly into starting servers, so every run shows how many it started.

A process counts when it serves: `python -m memory_service` and `python -m inference_node` given a `--port` (not
`--help` or a bad flag), `python -m precompute_worker` given a service, the offline engine scenario, and the
router, Prometheus, PostgreSQL and SeaweedFS binaries. Workers run in this process are counted by their runner."""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

ENGINE, OFFLINE_ENGINE = "vLLM engine (inference node)", "vLLM engine (offline scenario)"
SERVICE, WORKER_PROCESS = "memory service", "precompute worker (subprocess)"
IN_PROCESS_WORKER = "precompute worker (in-process)"
# module run with -m -> (kind, the flag a serving command line holds)
MODULES = {"inference_node": (ENGINE, "--port"), "memory_service": (SERVICE, "--port"),
           "precompute_worker": (WORKER_PROCESS, "--memory-service"), "harness.engine_scenario": (OFFLINE_ENGINE, "")}
# the last path component of a binary -> kind
BINARIES = {"vllm-router": "router", "prometheus": "Prometheus", "postgres": "PostgreSQL", "weed": "SeaweedFS"}
KINDS = (ENGINE, OFFLINE_ENGINE, SERVICE, WORKER_PROCESS, IN_PROCESS_WORKER, *BINARIES.values())
STARTED: Counter[str] = Counter()
_popen_init = subprocess.Popen.__init__


def kind_of(argv: Sequence[str]) -> str | None:
    """The kind of server `argv` starts, or None."""
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] in MODULES:
        kind, serving_flag = MODULES[argv[2]]
        return kind if not serving_flag or serving_flag in argv else None
    return BINARIES.get(str(argv[0]).rsplit("/", 1)[-1]) if argv else None


def _counting_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
    if isinstance(args, list | tuple) and (kind := kind_of([str(arg) for arg in args])):
        STARTED[kind] += 1
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _counting_init  # type: ignore[method-assign]


def report(terminalreporter: pytest.TerminalReporter) -> None:
    """Prints the counts (conftest's pytest_terminal_summary)."""
    terminalreporter.section("servers started")
    for kind in KINDS:
        terminalreporter.write_line(f"{kind}: {STARTED[kind]}")
