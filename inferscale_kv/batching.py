"""Calls that arrive while a batch is being computed wait for it and go together in the next one: one call of a
batch function per batch instead of one per item, with no added delay when idle (under load, per-item calls would
queue behind each other on the one thread that computes them). The memory service embeds its queries through one,
and so does a node that embeds queries itself (--embed-queries-locally)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class MicroBatcher(Generic[Item, Result]):
    """`await submit(item)` gives `compute(items)[i]` for its item, `compute` running on `executor` for at most
    `max_batch` items at a time. A failed batch fails each of its callers; a caller that stopped waiting (cancelled)
    is skipped. Use from one event loop."""

    def __init__(self, compute: Callable[[list[Item]], Iterable[Result]], executor: Executor, max_batch: int,
                 observe_batch: Callable[[int], None] = lambda size: None) -> None:
        self._compute = compute
        self._executor = executor
        self._max_batch = max_batch
        self._observe_batch = observe_batch
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._drain: asyncio.Task[None] | None = None

    async def submit(self, item: Item) -> Result:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self._pending.append((item, future))
        if self._drain is None:
            self._drain = loop.create_task(self._drain_pending())
        return await future

    async def _drain_pending(self) -> None:
        try:
            while self._pending:
                batch = self._pending[: self._max_batch]
                del self._pending[: len(batch)]
                self._observe_batch(len(batch))
                try:
                    results = await asyncio.get_running_loop().run_in_executor(
                        self._executor, self._compute, [item for item, _ in batch])
                except Exception as error:  # every waiter gets the failure; the next batch runs
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():  # a cancelled caller (deadline, disconnect) is skipped
                        future.set_result(result)
        finally:
            self._drain = None
