"""Per-load timing for benchmarks, chosen once when the worker role is built (`load_timer`), so that the engine path
never asks whether it is being measured.

`UNTIMED` (serving) does nothing. `JsonLinesLoadTimer` (`NodeSettings.load_stats_path`) synchronizes the device at
each reading, so a phase's time is its device work too, and appends one JSON line per load (every load reads the
node cache only): request_id, tokens, chunks, ms (= stage_ms + compose_ms + write_ms), stage_ms (finding the
chunks in the node cache; the key's name is older than the node cache), compose_ms, write_ms.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

import torch

from inference_node.connector.metadata import LoadSpec
from inference_node.settings import NodeSettings


class LoadTimer(Protocol):
    def now(self) -> float:
        """A reading (seconds) to measure a phase from."""
        ...

    def mark(self, phase: str) -> None:
        """The load being written ended `phase` ("compose", then "write")."""
        ...

    def record(self, spec: LoadSpec, lookup_ms: float, write_started: float, loads_in_step: int) -> None:
        """One load's work: finding its chunks in the node cache (`lookup_ms`, reported as `stage_ms`), then
        composing and writing from `write_started` to the marks: the step's write, shared by its `loads_in_step`
        loads (reported with each)."""
        ...


def load_timer(settings: NodeSettings) -> LoadTimer:
    """The timer the node's settings ask for."""
    return JsonLinesLoadTimer(settings.load_stats_path) if settings.load_stats_path else UNTIMED


class Untimed:
    def now(self) -> float:
        return 0.0

    def mark(self, phase: str) -> None:
        return

    def record(self, spec: LoadSpec, lookup_ms: float, write_started: float, loads_in_step: int) -> None:
        return


UNTIMED = Untimed()


class JsonLinesLoadTimer:
    def __init__(self, path: str) -> None:
        self.path = path
        self._phase_ends: dict[str, float] = {}

    def now(self) -> float:
        """The time after the device finished the work launched so far."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, phase: str) -> None:
        self._phase_ends[phase] = self.now()

    def record(self, spec: LoadSpec, lookup_ms: float, write_started: float, loads_in_step: int) -> None:
        ends = self._phase_ends
        compose_ms, write_ms = (ends["compose"] - write_started) * 1000, (ends["write"] - ends["compose"]) * 1000
        record = {"request_id": spec.request_id, "tokens": spec.end - spec.start, "chunks": len(spec.chunks),
                  "ms": lookup_ms + compose_ms + write_ms, "stage_ms": lookup_ms, "compose_ms": compose_ms,
                  "write_ms": write_ms, "loads_in_step": loads_in_step}
        with open(self.path, "a") as stats_file:
            stats_file.write(json.dumps(record) + "\n")
