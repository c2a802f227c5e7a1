"""Predictive scale-out as a Ray Serve custom autoscaling policy: reactive, but never below the schedule.

Ray Serve instantiates the class with `policy_kwargs` and calls it each control-loop tick; its wrapper
then applies min/max replicas and the up/downscale delays, as for the built-in policy.
"""

from __future__ import annotations

import time

from fleet.schedule import Schedule, reactive_replicas


class PredictivePolicy:
    def __init__(self, points: list, period_s: float = 86400.0, origin: float = 0.0, lead_s: float = 60.0,
                 target_ongoing_requests: float = 4.0):
        self.schedule = Schedule(tuple((float(t), int(r)) for t, r in points), period_s, origin)
        self.lead_s = lead_s
        self.target = target_ongoing_requests

    def decide(self, now: float, ongoing_requests: float, current: int) -> tuple[int, dict]:
        reactive = reactive_replicas(ongoing_requests, self.target)
        planned = self.schedule.planned(now, self.lead_s)
        return max(reactive, planned), {"planned": planned, "reactive": reactive, "current": current}

    def __call__(self, ctx) -> tuple[int, dict]:
        now = ctx.current_time or time.time()
        return self.decide(now, float(ctx.total_num_requests), ctx.current_num_replicas)
