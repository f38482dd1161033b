"""Small statistics helpers shared by the benchmarks."""

from __future__ import annotations

import numpy as np


def percentiles_ms(samples_s: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """Latency percentiles in milliseconds, keyed "p50", "p90", ..., plus "mean"."""
    if not samples_s:
        return {f"p{point}": float("nan") for point in points} | {"mean": float("nan")}
    values = np.asarray(samples_s) * 1000.0
    result = {f"p{point}": float(np.percentile(values, point)) for point in points}
    result["mean"] = float(values.mean())
    return result
