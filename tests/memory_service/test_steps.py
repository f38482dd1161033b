"""The per-RPC step clock: a no-op outside an RPC, steps done twice add up, concurrent calls keep their own."""

import asyncio
import contextvars

from memory_service.steps import start_step_clock, step_done


def test_marking_a_step_outside_an_rpc_does_nothing() -> None:
    contextvars.Context().run(step_done, "anything")  # no clock in this context: nothing to raise or record


def test_a_step_done_twice_adds_up_and_each_is_timed_from_the_one_before() -> None:
    def call() -> dict[str, float]:
        clock = start_step_clock()
        step_done("a")
        step_done("b")
        step_done("a")
        return clock.ms

    steps = contextvars.Context().run(call)
    assert list(steps) == ["a", "b"] and all(ms >= 0 for ms in steps.values())


async def test_concurrent_calls_each_fill_their_own_clock() -> None:
    async def call(name: str) -> dict[str, float]:
        clock = start_step_clock()
        await asyncio.sleep(0.01)
        step_done(name)
        await asyncio.sleep(0.01)
        step_done("after")
        return clock.ms

    first, second = await asyncio.gather(asyncio.create_task(call("first")), asyncio.create_task(call("second")))
    assert list(first) == ["first", "after"] and list(second) == ["second", "after"]
