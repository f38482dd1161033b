"""Real servers shared by configuration across the test session.

A test asks for a memory service by its flags, and for an inference node by its memory service, model and flags:
the first ask starts the process, every later ask with the same configuration gets the same one, and all of them
stop when the session ends. Tests that stop, kill or reconfigure a server start their own (the harness classes),
never one from here.

Data stays apart by user: each test module names its users under a namespace of its own (`Users`), so a module
sees only the facts, KV and figures of the users it made, whoever else shares the service. Figures of a whole
service (GetStats without a user, /metrics counters) are read as differences, or from a server of the module's own.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess

# The node stack most node tests share. Its memory service keeps no host tier, so that disk corruption reaches the
# node; its fp32 tiny-Llama node injects every fact with KV unless a request asks for a tail, and a request whose KV
# is not resident waits for it (--kv-miss-policy wait: what each test loads does not hang on measured speeds; the
# policy's other outcomes are tested in the engine scenario, tests/inference_node/test_engine_node_cache.py); it keeps
# a host tier, which a CPU node has none of by default.
NODE_SERVICE_FLAGS = ("--kv-host-budget-mb", "0")
# A service whose tests play workers uploading made-up KV, which the sampled audit would rightly withdraw.
UNAUDITED = ("--kv-audit-share", "0")
NODE_FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--seed", "0", "--retrieve-timeout-s", "30",
              "--recompute-tail-facts", "0", "--kv-miss-policy", "wait", "--host-tier-mb", "64")


class ServerPool:
    """One started server per configuration, for the whole session; `close` stops them all."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._services: dict[tuple[str, ...], MemoryServiceProcess] = {}
        self._nodes: dict[tuple[str, ...], InferenceNodeProcess] = {}
        self._stack = contextlib.ExitStack()

    def memory_service(self, *flags: str) -> MemoryServiceProcess:
        """The shared memory service started with `flags` (on a data directory of its own). One that a test stopped
        is started again, on its address and data, before it is handed out."""
        if flags not in self._services:
            root = self._root / f"service-{len(self._services)}"
            service = MemoryServiceProcess(root / "data", root / "service.log", *flags)
            self._stack.callback(_stop_service, service)
            self._services[flags] = service.start()
        service = self._services[flags]
        if service.process is not None and service.process.poll() is not None:
            service.start()
        return service

    def node(self, service: MemoryServiceProcess, model_dir: Path, *flags: str) -> InferenceNodeProcess:
        """The shared inference node for `model_dir` with `flags` in front of `service` (one of this pool's)."""
        key = (service.address, str(model_dir), *flags)
        if key not in self._nodes:
            node = InferenceNodeProcess(service.address, model_dir, self._root / f"node-{len(self._nodes)}", *flags)
            self._stack.callback(node.stop)
            self._nodes[key] = node.start()
        return self._nodes[key]

    def close(self) -> None:
        self._stack.close()


def _stop_service(service: MemoryServiceProcess) -> None:
    if service.process is not None and service.process.poll() is None:
        service.stop()


class Users:
    """A test module's user ids: `users("ana")` is `ana` under the module's namespace, which no other module's
    users share. A tenant-qualified name keeps its tenant first (`acme/ana` -> `acme/<namespace>.ana`)."""

    def __init__(self, module_name: str) -> None:
        self.namespace = re.sub(r"[^A-Za-z0-9]+", "-", module_name.rsplit(".", 1)[-1].removeprefix("test_"))

    def __call__(self, name: str) -> str:
        tenant, _, user = name.rpartition("/")
        return f"{tenant}/{self.namespace}.{user}" if tenant else f"{self.namespace}.{user}"


@contextlib.contextmanager
def server_pool(root: Path) -> Iterator[ServerPool]:
    pool = ServerPool(root)
    try:
        yield pool
    finally:
        pool.close()
