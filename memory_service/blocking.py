"""Where the service's blocking calls run (the coordination database, KV tiers, file and object-store I/O).

Reads and writes wait for threads in separate queues: under a flood of RetrieveAndStage calls the read threads are
all busy and their queue grows, and a write queued behind them stalls (benchmarks/RESULTS.md, "Memory service under
load": the three-replica run's deadline). A write RPC runs its blocking calls on the write threads, the workers' KV
traffic on threads of its own (`blocking_calls_on`, set by the rpc wrapper per method); everything else on the event
loop's default executor, which on a shared store is the builder's read threads (memory_service.builder)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

_EXECUTOR: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("blocking_executor", default=None)


async def run_blocking(function: Callable[..., T], /, *args) -> T:
    """`function(*args)` on a thread of the current executor (the one `blocking_calls_on` set, else the event loop's
    default executor), with the caller's context variables (log fields) as `asyncio.to_thread` does."""
    call = functools.partial(contextvars.copy_context().run, function, *args)
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR.get(), call)


@contextmanager
def blocking_calls_on(executor: Executor) -> Iterator[None]:
    """Blocking calls made inside (and in tasks created inside) run on `executor`."""
    token = _EXECUTOR.set(executor)
    try:
        yield
    finally:
        _EXECUTOR.reset(token)
