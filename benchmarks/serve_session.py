"""The servers of a serving benchmark (memory service, KV worker, inference node), recorded in a state file so that
they can outlive the call that started them: one call prepares them (`python -m benchmarks.serve --prepare STATE`),
later calls measure against them (`--attach STATE`), a last one stops them (`--stop STATE`). The lent GPU limits a
call to 10 minutes and keeps a machine, and the processes started in their own session, only while it stays warm.

A session records each process (pid, address, log) and the phases done (ingest, KV, node, each workload's warm-up),
so a prepare cut short resumes where it stopped; `gone()` names what died, for a caller to say so clearly.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STATE_VERSION = 1


@contextlib.contextmanager
def exclusive(state: Path) -> Iterator[None]:
    """Holds the state file's lock (one prepare at a time); says whom it waits for when another holds it."""
    state.parent.mkdir(parents=True, exist_ok=True)
    with open(state.with_name(state.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            print(f"waiting for the prepare already running on {state} (pid {lock.read().strip() or '?'})",
                  flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        yield


@dataclass
class ServerProcess:
    """A process the session started: its pid, what its command line holds (so that a pid the system gave to
    another process since is not taken for it), where it serves (host:port or URL), and its log."""

    pid: int
    command: str
    address: str = ""
    log: str = ""
    own_session: bool = False  # started with its own process group (the node): stopped as a group

    def running(self) -> bool:
        """The process exists, is no zombie, and is the one started."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
            command = Path(f"/proc/{self.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z" and self.command in command

    def stop(self, timeout_s: float = 60.0) -> None:
        if not self.running():
            return
        kill = (lambda sig: os.killpg(self.pid, sig)) if self.own_session else (lambda sig: os.kill(self.pid, sig))
        try:
            kill(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.5)
            if self.running():
                kill(signal.SIGKILL)
        except ProcessLookupError:
            return


@dataclass
class Session:
    """Where a benchmark's servers are and what was done with them; saved after every change when `path` is set."""

    work_dir: str
    path: str = ""  # the state file; empty for a run that stops its servers itself
    setup: dict[str, Any] = field(default_factory=dict)  # the arguments its memories and servers were made with
    model_dir: str = ""
    service: ServerProcess | None = None
    service_metrics_port: int = 0
    worker: ServerProcess | None = None
    node: ServerProcess | None = None
    preparer: ServerProcess | None = None  # the prepare that made it (it may still run, cut at a call's limit)
    node_cache_mb: int | None = None
    done: list[str] = field(default_factory=list)  # phases done: "ingest", "kv", "warm:<workload>"

    def save(self) -> None:
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            temporary = Path(self.path + ".tmp")
            temporary.write_text(json.dumps({"version": STATE_VERSION, **asdict(self)}, indent=1))
            temporary.replace(self.path)

    @classmethod
    def load(cls, path: Path) -> Session:
        raw = json.loads(path.read_text())
        if raw.pop("version", None) != STATE_VERSION:
            raise SystemExit(f"{path}: not a serving benchmark state file of this version")
        processes = {name: ServerProcess(**raw[name]) if raw.get(name) else None
                     for name in ("service", "worker", "node", "preparer")}
        return cls(**{**raw, **processes})

    def mark(self, phase: str) -> None:
        self.done.append(phase)
        self.save()

    def service_healthy(self) -> bool:
        if self.service is None or not self.service.running():
            return False
        try:
            with grpc.insecure_channel(self.service.address) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            return status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def node_healthy(self) -> bool:
        if self.node is None or not self.node.running():
            return False
        try:
            with urllib.request.urlopen(f"{self.node.address}/health", timeout=10) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def gone(self) -> list[str]:
        """What of the memory service and node is not serving (each with its pid and log), empty if both are."""
        missing = []
        for name, process, healthy in (("memory service", self.service, self.service_healthy()),
                                       ("inference node", self.node, self.node_healthy())):
            if process is None:
                missing.append(f"{name}: never started")
            elif not healthy:
                state = "running but not healthy" if process.running() else "exited"
                missing.append(f"{name} (pid {process.pid}) {state}; log {process.log}")
        return missing

    def stop(self) -> None:
        """Stops a prepare still running (it stops what it has not recorded yet), then the node, the worker and the
        memory service (the node first: it calls the service)."""
        for process in (self.preparer, self.node, self.worker, self.service):
            if process is not None and process.pid != os.getpid():
                process.stop()
