"""Watching the KV pipeline from outside: a progress bar over GetStats while a worker runs."""

from __future__ import annotations

import subprocess
import time

from tqdm import tqdm

from inferscale.v1 import memory_pb2 as pb


def wait_for_kv(stub, total: int, worker: subprocess.Popen, poll_interval_s: float = 0.5) -> int:
    """Shows facts with stored KV (best profile) until `total` are done or the worker exits; returns done."""
    done = 0
    with tqdm(total=total, desc="precomputing fact KV", unit="fact") as progress:
        while True:
            done = max((p.done for p in stub.GetStats(pb.GetStatsRequest()).profiles), default=0)
            progress.update(done - progress.n)
            if done >= total or worker.poll() is not None:
                return done
            time.sleep(poll_interval_s)
