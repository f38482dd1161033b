"""Starts `python -m memory_service` as a child process (for the demo, benchmarks and tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inferscale_kv.runtime import free_port

STARTUP_TIMEOUT_S = 180.0


def shared_embedding_cache_dir() -> Path:
    """The user's cache for exported embedding models ($XDG_CACHE_HOME/inferscale/embedding-onnx)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferscale" / "embedding-onnx"


class MemoryServiceProcess:
    """A memory service on free loopback ports; `start` returns once health says SERVING."""

    def __init__(self, data_dir: Path, log_path: Path, *extra_args: str, health_port: bool = False,
                 env: dict[str, str] | None = None, source: Path | None = None) -> None:
        """`health_port`: serve health alone in plaintext on its own port and wait on that one (for TLS runs);
        `env`: added to the process's environment (e.g. object-store credentials); `source`: a checkout to run the
        service's code from (its working directory, which `python -m` imports from first)."""
        self.data_dir = data_dir
        self.log_path = log_path
        self.extra_args = extra_args
        self.env = env or {}
        self.source = source
        self.port = free_port()
        self.metrics_port = free_port()
        self.health_port = free_port() if health_port else None
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The started service's process id."""
        assert self.process is not None, "not started"
        return self.process.pid

    def start(self) -> MemoryServiceProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **self.env}
        # Services started here share one exported embedding model instead of exporting one per data directory.
        env.setdefault("INFERSCALE_EMBEDDING_CACHE_DIR", str(shared_embedding_cache_dir()))
        command = [
            sys.executable, "-m", "memory_service",
            "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--data-dir", str(self.data_dir), *self.extra_args,
            *(("--health-port", str(self.health_port)) if self.health_port else ()),
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                            cwd=self.source)
        self._wait_serving()
        return self

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        health_address = f"127.0.0.1:{self.health_port}" if self.health_port else self.address
        with grpc.insecure_channel(health_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(f"memory service exited early:\n{self.log_path.read_text()[-4000:]}")
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"memory service not SERVING after {STARTUP_TIMEOUT_S}s; log {self.log_path} ends:\n"
                           f"{self.log_path.read_text(errors='replace')[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Sends `sig` and waits for the exit; returns the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=60)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)
