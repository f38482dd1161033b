"""Starts `python -m inference_node` as a child process (demo, benchmarks, tests) and waits for /health."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from inferscale_kv.runtime import free_port

STARTUP_TIMEOUT_S = 420.0


class InferenceNodeProcess:
    def __init__(self, memory_service: str, model_dir: Path, work_dir: Path, *extra_args: str,
                 env: dict[str, str] | None = None) -> None:
        self.memory_service = memory_service
        self.model_dir = model_dir
        self.work_dir = work_dir
        self.extra_args = extra_args
        self.extra_env = env or {}
        self.port = free_port()
        self.log_path = work_dir / "inference_node.log"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> InferenceNodeProcess:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        rpc_dir = self.work_dir / "rpc"
        rpc_dir.mkdir(exist_ok=True)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_RPC_BASE_PATH": str(rpc_dir),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                      str(Path(".cache/inductor").resolve())),
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self.extra_env,
        }
        command = [sys.executable, "-m", "inference_node", "--memory-service", self.memory_service,
                   "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
                   *self.extra_args]
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"inference node exited early:\n{self.log_path.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"inference node not healthy after {STARTUP_TIMEOUT_S}s; log: {self.log_path}")

    def stop(self) -> None:
        """Stops vLLM and its engine processes (the whole process group)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
