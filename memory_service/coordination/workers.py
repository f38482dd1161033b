"""Precompute workers as they last reported themselves (table `workers`), with each lease request."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

from memory_service.sql import Database


@dataclass(frozen=True)
class WorkerDevice:
    """A worker's accelerator, as it last read it (inferscale_kv.device_telemetry.DeviceReading)."""

    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int


@dataclass(frozen=True)
class WorkerReport:
    worker_id: str
    profile_id: str
    last_seen: float  # seconds since the epoch
    facts_per_second: float
    device: WorkerDevice | None = None  # None: no accelerator


class WorkerRegistry:
    def __init__(self, database: Database) -> None:
        self._database = database

    def record(self, report: WorkerReport) -> None:
        device = dataclasses.asdict(report.device) if report.device else {}
        with self._database.transaction() as tx:
            tx.run("INSERT INTO workers VALUES (?, ?, ?, ?, ?) ON CONFLICT (worker_id) DO UPDATE SET "
                   "profile_id = excluded.profile_id, last_seen = excluded.last_seen, "
                   "facts_per_second = excluded.facts_per_second, device = excluded.device",
                   (report.worker_id, report.profile_id, report.last_seen, report.facts_per_second,
                    json.dumps(device, sort_keys=True)))

    def recent(self, seen_within_s: float) -> list[WorkerReport]:
        """Workers that reported within the last `seen_within_s` seconds, most recent first."""
        rows = self._database.query("SELECT worker_id, profile_id, last_seen, facts_per_second, device FROM workers "
                                    "WHERE last_seen >= ? ORDER BY last_seen DESC", (time.time() - seen_within_s,))
        reports = []
        for worker, profile, seen, rate, device in rows:
            fields = json.loads(device)
            reports.append(WorkerReport(worker, profile, seen, rate, WorkerDevice(**fields) if fields else None))
        return reports
