"""Summaries of measured latencies: percentiles as numpy computes them, and ratios that tolerate gaps."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values: Iterable[float | None], scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean, median, p50/p95/p99, min, max of the non-None values, each multiplied by `scale`."""
    data = [v * scale for v in values if v is not None]
    if not data:
        return {"count": 0, "mean": None, "median": None, "p50": None, "p95": None, "p99": None,
                "min": None, "max": None}
    median = percentile(data, 50)
    return {
        "count": len(data),
        "mean": sum(data) / len(data),
        "median": median,
        "p50": median,
        "p95": percentile(data, 95),
        "p99": percentile(data, 99),
        "min": min(data),
        "max": max(data),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator
