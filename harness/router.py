"""Starts vLLM's router (`vllm-router`, the vLLM project's Rust load balancer, from the `vllm-router` wheel) in front of
inference nodes on loopback, for the fleet tests and benchmarks, and reads the Prometheus counters of both.

What the installed release (0.1.17) does, checked against it (deploy/README.md, "A fleet of nodes behind the router"):
`consistent_hash` hashes the first of the headers x-session-id, x-user-id, x-tenant-id, x-correlation-id,
x-request-id, x-trace-id that a request carries, onto a ring of the workers whose health and circuit breaker admit
them, so a worker that leaves or comes back moves only its own share of the keys. A request carrying none of them
is hashed on its prompt text instead (every chat request on the same key). Requests and response headers pass
through unchanged, the body re-serialized with the fields the router knows filled in.

`power_of_two` (for the requests that name no user) draws two healthy workers at random and sends the request to the
one with fewer requests in flight from this router process (its own count: vLLM has no `/get_load`, which the policy
also polls, getting 404, and ignores), so an idle worker takes the requests a busy one would queue; with equal
counts the pick is random. It reads no header. Every decision counts in
`vllm_router_policy_decisions_total{policy="power_of_two",worker=...}`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from harness.inference_node import InferenceNodeProcess
from inferscale_kv.runtime import free_port

STARTUP_TIMEOUT_S = 120.0
# The header naming the caller's user: the router's consistent hash reads it (only x-session-id ranks above it, so
# the gateway removes a client's x-session-id) and the nodes' --user-header binds memory.user_id to it.
USER_HEADER = "x-user-id"
# --routing name -> the router's --policy: by user (the fleet's routing of requests that name one), by load (of the
# requests that name none), and round robin (for comparison).
ROUTINGS = {"consistent-hash": "consistent_hash", "power-of-two": "power_of_two", "round-robin": "round_robin"}
# A worker that fails a request twice in a row (a refused connection, a 5xx) opens its circuit breaker: the same
# request's next retry is routed over the ring of the others, so a node that dies costs its users no error. The
# breaker retries the worker after 5 s, and a health check every 5 s notices one that came back.
FAILOVER_FLAGS = ("--retry-max-retries", "5", "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "5",
                  "--health-check-interval-secs", "5")


def router_binary() -> str:
    """The `vllm-router` launcher of this interpreter's environment (the test extra installs it)."""
    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if found is None:
        raise RuntimeError("vllm-router not found: pip install vllm-router (in the test extra)")
    return found


def prometheus_samples(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text endpoint: `name{labels}` (as exposed) -> value."""
    with urllib.request.urlopen(url, timeout=30) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line and not line.startswith("#")}


def metric_total(samples: dict[str, float], name: str, labels: str = "") -> float:
    """The sum of `name`'s samples over its label sets, or over those whose labels contain `labels` (`mode="kv"`)."""
    return sum(value for key, value in samples.items()
               if key.split("{")[0] == name and labels in key.partition("{")[2])


class RouterProcess:
    """`vllm-router` on free loopback ports (API and metrics) with static worker URLs; `start` returns once the
    router serves and reports every worker healthy."""

    def __init__(self, worker_urls: Sequence[str], work_dir: Path, routing: str = "consistent-hash",
                 *extra_args: str) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing: one of {', '.join(ROUTINGS)}, not {routing!r}")
        self.worker_urls = list(worker_urls)
        self.routing = routing
        self.extra_args = extra_args
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = work_dir / f"router-{routing}.log"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [router_binary(), "--host", "127.0.0.1", "--port", str(self.port), "--policy",
                   ROUTINGS[self.routing], "--worker-urls", *self.worker_urls, "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(self.metrics_port), *self.extra_args]
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited early:\n{self.log_path.read_text(errors='replace')[-4000:]}")
            try:
                if len(self.healthy_workers()) == len(self.worker_urls):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vllm-router not ready after {STARTUP_TIMEOUT_S}s; log: {self.log_path}")

    def healthy_workers(self) -> set[str]:
        """The URLs of the workers the router reports healthy."""
        with urllib.request.urlopen(f"{self.base_url}/workers", timeout=5) as response:
            return {worker["url"] for worker in json.loads(response.read())["workers"] if worker["is_healthy"]}

    def metrics(self) -> dict[str, float]:
        """The router's Prometheus samples (vllm_router_*)."""
        return prometheus_samples(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def remove_worker(self, url: str) -> None:
        """Takes a worker out of the routing (what the router does itself when Kubernetes deletes a node's pod)."""
        request = urllib.request.Request(f"{self.base_url}/remove_worker?url={url}", method="POST")
        with urllib.request.urlopen(request, timeout=30):
            pass

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def start_nodes(nodes: Sequence[InferenceNodeProcess]) -> list[InferenceNodeProcess]:
    """Starts the nodes side by side (each start waits minutes for vLLM) and returns them once all are healthy;
    stops the started ones and raises the first failure if one does not come up."""
    errors: list[Exception] = []

    def start(node: InferenceNodeProcess) -> None:
        try:
            node.start()
        except Exception as exc:  # raised below, once every start has ended
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(node,)) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for node in nodes:
            node.stop()
        raise errors[0]
    return list(nodes)


def kill_node(node: InferenceNodeProcess) -> None:
    """`kill -9` of the node: its API server and engine processes (one process group), with no chance to drain."""
    assert node.process is not None, "not started"
    os.killpg(node.process.pid, signal.SIGKILL)
    node.process.wait(timeout=30)
