"""Where an RPC's time went: the steps of a call, each timed from the end of the one before, reported on its
`rpc` log line (`steps_ms`). The servicer's `rpc` wrapper starts a clock per call; code on the request path marks a
step when it ends with `step_done`. Outside an RPC (start-up, background work) marking is a no-op."""

from __future__ import annotations

import contextvars
import time


class StepClock:
    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.ms: dict[str, float] = {}

    def step_done(self, step: str) -> None:
        """Charges the time since the previous step (or the start) to `step`; a step done twice adds up."""
        now = time.perf_counter()
        self.ms[step] = round(self.ms.get(step, 0.0) + (now - self._last) * 1000, 3)
        self._last = now


_CLOCK: contextvars.ContextVar[StepClock | None] = contextvars.ContextVar("rpc_step_clock", default=None)


def start_step_clock() -> StepClock:
    clock = StepClock()
    _CLOCK.set(clock)
    return clock


def step_done(step: str) -> None:
    clock = _CLOCK.get()
    if clock is not None:
        clock.step_done(step)
