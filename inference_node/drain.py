"""A stopping node takes no new work: from the signal that stops vLLM's server on (SIGTERM, what Kubernetes sends;
SIGINT), the node's readiness (`GET /health`) and every new POST are answered 503, so the router and Kubernetes send
new requests to other nodes, while vLLM finishes the requests in flight (`--shutdown-timeout`).

Without it vLLM keeps admitting requests while it drains, and one that arrives after its engine has left its
loop, before the HTTP server closes, waits for an answer that never comes (deploy/README.md, "Draining a node").
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

LOGGER = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
READINESS_PATH = "/health"

_Handler = Callable[[int, FrameType | None], object] | int | None


class StopWatch:
    """Whether the server was told to stop; `install` starts watching."""

    def __init__(self) -> None:
        self._stopping = False
        self._installed = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    def install(self) -> None:
        """Chains a Python-level handler in front of each stop signal's; idempotent; from the main thread, once
        vLLM's server has registered its own (its asyncio loop's signal handlers, which still run: the loop learns of
        a signal through the wakeup fd that Python's C-level handler writes, whatever the Python-level handler)."""
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            LOGGER.warning("not the main thread: a stopping node will not refuse new requests")
            return
        for stop_signal in STOP_SIGNALS:
            signal.signal(stop_signal, self._chained(signal.getsignal(stop_signal)))
            signal.siginterrupt(stop_signal, False)  # as the loop had it: a signal does not interrupt system calls
        self._installed = True

    def _chained(self, previous: _Handler) -> Callable[[int, FrameType | None], None]:
        def handler(signum: int, frame: FrameType | None) -> None:
            if not self._stopping:
                LOGGER.info("stop signal %d: the node answers new requests 503 while vLLM drains", signum)
            self._stopping = True
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # nothing else registered: the signal's default, as before
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        return handler

    def refuses(self, method: str | None, path: str | None) -> bool:
        """Whether a request is answered 503: while stopping, readiness and every POST (new work); other GETs (the
        metrics, liveness on /ping) pass."""
        return self._stopping and (method == "POST" or path == READINESS_PATH)
