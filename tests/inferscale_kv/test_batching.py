"""MicroBatcher: calls that arrive while a batch runs go together in the next one."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from inferscale_kv.batching import MicroBatcher


def test_items_submitted_while_a_batch_runs_share_the_next_call() -> None:
    release = threading.Event()
    batches: list[list[int]] = []

    def square(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) == 1:
            release.wait(5)  # the first batch runs while the others arrive
        return [item * item for item in items]

    async def run() -> list[int]:
        batcher = MicroBatcher(square, ThreadPoolExecutor(1), max_batch=3)
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(batcher.submit(item)) for item in range(2, 7)]
        await asyncio.sleep(0.05)
        release.set()
        return [await first, *[await future for future in rest]]

    assert asyncio.run(run()) == [1, 4, 9, 16, 25, 36]
    assert batches == [[1], [2, 3, 4], [5, 6]]  # at most max_batch items per call


def test_a_failed_batch_fails_its_callers_and_the_next_batch_runs() -> None:
    def fail_on_two(items: list[int]) -> list[int]:
        if 2 in items:
            raise RuntimeError("model down")
        return items

    async def run() -> tuple[BaseException | int, ...]:
        batcher = MicroBatcher(fail_on_two, ThreadPoolExecutor(1), max_batch=1)
        return tuple(await asyncio.gather(*(batcher.submit(item) for item in (1, 2, 3)), return_exceptions=True))

    one, two, three = asyncio.run(run())
    assert (one, three) == (1, 3) and isinstance(two, RuntimeError)


def test_a_caller_that_stopped_waiting_is_skipped() -> None:
    async def run() -> int:
        batcher = MicroBatcher(lambda items: items, ThreadPoolExecutor(1), max_batch=4)
        cancelled = asyncio.ensure_future(batcher.submit(1))
        kept = asyncio.ensure_future(batcher.submit(2))
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return await kept

    assert asyncio.run(run()) == 2
