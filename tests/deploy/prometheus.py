"""A real Prometheus server for the monitoring tests: Debian's `prometheus` binary on a free loopback port, with a
generated configuration (static targets per job, a one-second scrape and rule interval) and its own data
directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from inferscale_kv.runtime import free_port

STARTUP_TIMEOUT_S = 60.0


class PromQLError(Exception):
    """Prometheus refused a query (it does not parse, or cannot be evaluated)."""


class PrometheusServer:
    def __init__(self, work_dir: Path, jobs: dict[str, list[str]], rule_files: list[Path]) -> None:
        """`jobs`: each job's `host:port` targets, scraped at /metrics."""
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed: `make test` installs Debian's prometheus package"
        self.binary = binary
        self.work_dir = work_dir
        self.jobs = jobs
        self.rule_files = rule_files
        self.port = free_port()
        self.log_path = work_dir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                               for job, targets in self.jobs.items()],
        }
        config_path = self.work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        command = [self.binary, f"--config.file={config_path}", f"--storage.tsdb.path={self.work_dir / 'data'}",
                   f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"]
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {STARTUP_TIMEOUT_S}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def api(self, path: str, **params: str) -> Any:
        """The `data` of an HTTP API answer (/api/v1/<path>); PromQLError with Prometheus's message on an error."""
        url = f"{self.base_url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as error:
            answer = json.loads(error.read() or b"{}")
        if answer.get("status") != "success":
            raise PromQLError(f"{answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (each element: `metric` labels and `value` [time, "number"])."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise PromQLError(f"a {data['resultType']} result, not a vector: {expr}")
        return data["result"]

    def series(self, selector: str) -> list[dict[str, str]]:
        """The label sets of every series `selector` matches."""
        return self.api("series", **{"match[]": selector})
