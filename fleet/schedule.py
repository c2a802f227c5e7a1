"""A known traffic profile: replicas wanted over the day (or any period), for predictive scale-out."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Schedule:
    """Step function: from `points[i][0]` seconds into the period, `points[i][1]` replicas."""

    points: tuple[tuple[float, int], ...]
    period_s: float = 86400.0
    origin: float = 0.0  # epoch seconds where the period starts (0: UTC midnight for a daily profile)

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a schedule needs at least one (seconds, replicas) point")
        if any(r < 0 or not 0 <= t < self.period_s for t, r in self.points):
            raise ValueError(f"schedule points must be 0 <= seconds < {self.period_s} and replicas >= 0")

    def replicas_at(self, now: float) -> int:
        t = (now - self.origin) % self.period_s
        starts = [p[0] for p in self.points]
        i = bisect.bisect_right(starts, t) - 1
        return int(self.points[i][1])  # before the first point, the last one still holds (it wraps)

    def planned(self, now: float, lead_s: float) -> int:
        """What the schedule wants now or within `lead_s`: scale out ahead, never in ahead."""
        return max(self.replicas_at(now), self.replicas_at(now + lead_s))

    def as_kwargs(self) -> dict:
        return {"points": [list(p) for p in self.points], "period_s": self.period_s, "origin": self.origin}


def load_schedule(path: str | Path) -> Schedule:
    """YAML `{period_s, origin, points: [[seconds, replicas], ...]}` or CSV lines `seconds,replicas`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"schedule file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".csv":
        rows = [line.split(",") for line in text.splitlines() if line.strip() and not line.startswith("#")]
        rows = [r for r in rows if r[0].strip().replace(".", "", 1).isdigit()]  # skip a header
        data = {"points": [[float(a), int(b)] for a, b, *_ in rows]}
    else:
        data = yaml.safe_load(text) or {}
    points = tuple(sorted((float(t), int(r)) for t, r in data.get("points", [])))
    return Schedule(points, float(data.get("period_s", 86400.0)), float(data.get("origin", 0.0)))


def reactive_replicas(ongoing_requests: float, target_ongoing: float) -> int:
    """Ray Serve's rule: ongoing requests over the per-replica target, rounded up."""
    return math.ceil(ongoing_requests / target_ongoing) if ongoing_requests > 0 else 0
