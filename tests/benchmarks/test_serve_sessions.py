"""Servers that outlive the call that started them (benchmarks/serve_session.py, benchmarks.serve --prepare /
--attach / --stop, benchmarks/device_run.sh), and contenders kept off each other's prefix-cache blocks, without
vLLM."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serve import (
    KV_AUTO,
    WorkloadPlan,
    _attach,
    _memories,
    contender_users,
    isolation_namespaces,
    plan_contenders,
)
from benchmarks.serve_requests import CONTENDERS, synthetic_workload
from benchmarks.serve_session import ServerProcess, Session

REPO = Path(__file__).resolve().parents[2]


def test_only_contenders_that_could_send_another_contenders_very_request_get_users_of_their_own() -> None:
    tails = {"kv-tail1": {**CONTENDERS["kv"], "recompute_tail_facts": 1}}
    contenders = {**CONTENDERS, "kv-auto": KV_AUTO, **tails, "kv-warm": CONTENDERS["kv"]}
    # kv-auto is kv's request above the crossover and text's below it; kv-warm is kv's; a tail's plan is its own.
    assert isolation_namespaces(contenders) == {"kv-auto": "kv-auto", "kv-warm": "kv-warm"}
    assert isolation_namespaces(CONTENDERS) == {}


def test_isolated_users_hold_the_same_memories_under_other_names() -> None:
    workload = synthetic_workload(2, 3, 1)
    plan = WorkloadPlan("cold", workload, [2], warm_users=workload.users[:1])
    contenders = plan_contenders(argparse.Namespace(tails=[], kv_auto=True), [plan])
    namespaces = isolation_namespaces(contenders)
    assert contender_users(plan, "kv-auto", namespaces) == {user: f"{user}.kv-auto" for user in workload.users}
    assert contender_users(plan, "kv-warm", namespaces) == {"bench-user-0": "bench-user-0.kv-warm"}
    assert contender_users(plan, "text", namespaces) == {user: user for user in workload.users}
    memories = _memories([plan], contenders, namespaces)
    assert memories.users == ["bench-user-0", "bench-user-1", "bench-user-0.kv-auto", "bench-user-1.kv-auto",
                              "bench-user-0.kv-warm", "bench-user-0.kv-host", "bench-user-1.kv-host"]
    # kv-second asks kv's own users their second question: no copies
    assert contender_users(plan, "kv-second", namespaces) == contender_users(plan, "kv", namespaces)
    assert "kv-second" not in namespaces and namespaces["kv-host"] == "kv-host"
    assert memories.facts["bench-user-1.kv-auto"] == workload.facts["bench-user-1"]
    assert memories.questions["bench-user-0.kv-warm"] == workload.questions["bench-user-0"]


def _sleeper() -> subprocess.Popen:
    """A process standing in for a server, returned once its command line is its own (right after the fork it is
    still the parent's, and a ServerProcess would not know it as the one started: a clean-clone run failed so)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    deadline = time.monotonic() + 30
    while b"time.sleep" not in Path(f"/proc/{sleeper.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return sleeper


def test_another_node_on_prepared_memories_when_only_the_node_flags_differ(tmp_path: Path) -> None:
    from benchmarks.serve import _only_node_flags_differ, _replace_node

    setup = {"workloads": ["cold"], "cold_users": 4, "node_flags": "--dtype float32", "namespaces": {}}
    waiting = {**setup, "node_flags": "--dtype float32 --kv-miss-policy wait"}
    assert _only_node_flags_differ(setup, waiting)
    assert not _only_node_flags_differ(setup, {**waiting, "cold_users": 8})
    assert not _only_node_flags_differ(setup, setup)
    sleeper = _sleeper()
    session = Session(str(tmp_path), str(tmp_path / "state.json"), dict(setup), done=["ingest", "kv", "warm:cold"])
    session.node = ServerProcess(sleeper.pid, "time.sleep", "http://127.0.0.1:9", own_session=True)
    _replace_node(session, waiting["node_flags"])
    assert sleeper.wait(timeout=30) != 0
    loaded = Session.load(tmp_path / "state.json")
    assert loaded.node is None and loaded.done == ["ingest", "kv"] and loaded.setup == waiting


def test_a_session_survives_its_state_file_and_stops_its_processes_by_pid(tmp_path: Path) -> None:
    sleeper = _sleeper()
    session = Session(str(tmp_path / "work"), str(tmp_path / "state.json"), {"workloads": ["synthetic"]})
    session.node = ServerProcess(sleeper.pid, "time.sleep", "http://127.0.0.1:9", "node.log", own_session=True)
    assert not ServerProcess(sleeper.pid, "inference_node").running()  # that pid is not a node
    session.mark("ingest")
    loaded = Session.load(tmp_path / "state.json")
    assert loaded == session and loaded.node is not None and loaded.node.running()
    assert loaded.gone() == ["memory service: never started",
                             f"inference node (pid {sleeper.pid}) running but not healthy; log node.log"]
    loaded.stop()
    assert sleeper.wait(timeout=30) != 0 and not loaded.node.running()
    assert loaded.gone()[1] == f"inference node (pid {sleeper.pid}) exited; log node.log"


def test_attaching_to_servers_that_are_gone_says_so(tmp_path: Path) -> None:
    args = argparse.Namespace(attach=str(tmp_path / "state.json"), workloads=["synthetic"], workloads_given=False)
    parser = argparse.ArgumentParser()
    with pytest.raises(SystemExit, match="no prepared servers"):
        _attach(args, parser)
    Session(str(tmp_path), str(tmp_path / "state.json"), {"workloads": ["synthetic"]}, done=["warm:synthetic"]).save()
    with pytest.raises(SystemExit, match="gone .rerun the prepare stage.:\n  memory service: never started"):
        _attach(args, parser)


def _device_run(tmp_path: Path, stage: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "INFERSCALE_BENCH_DIR": str(tmp_path / "bench"), "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "benchmarks/device_run.sh", str(tmp_path / "out"), stage], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_device_run_names_its_stages_and_a_measuring_stage_without_its_servers_exits_4(tmp_path: Path) -> None:
    unknown = _device_run(tmp_path, "everything")
    assert unknown.returncode == 2 and "prepare-latency|latency|long" in unknown.stderr
    orphan = _device_run(tmp_path, "throughput")
    assert orphan.returncode == 4, orphan.stdout[-2000:] + orphan.stderr[-2000:]
    assert "run the prepare-throughput stage again" in orphan.stderr
    assert "no prepared servers" in (tmp_path / "out" / "serve-throughput.txt").read_text()
    for stage, prepare in (("cold", "prepare-cold"), ("cold-wait", "prepare-cold-wait"),
                           ("defaults", "prepare-defaults")):
        orphan = _device_run(tmp_path, stage)
        assert orphan.returncode == 4 and f"run the {prepare} stage again" in orphan.stderr, orphan.stderr[-2000:]
    assert _device_run(tmp_path, "stop").returncode == 0


def test_one_prepare_at_a_time_on_a_state_file(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from benchmarks.serve_session import exclusive\n"
                               f"with exclusive(Path({str(state)!r})):\n    print('held', flush=True)\n"
                               "    time.sleep(3)\n"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    waiter = subprocess.run([sys.executable, "-c", "from pathlib import Path\n"
                             "from benchmarks.serve_session import exclusive\n"
                             f"with exclusive(Path({str(state)!r})):\n    print('got it')\n"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert waiter.stdout.splitlines() == [f"waiting for the prepare already running on {state} (pid {holder.pid})",
                                          "got it"]
    assert holder.wait(timeout=30) == 0
