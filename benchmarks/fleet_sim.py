"""A discrete-event simulation of a fleet under a bursty trace, driven by measured replica numbers.

Replicas take `cold_start_s` from the scale-out decision to their first request, serve `slots`
requests at once, each for `service_s`, and answer the first token `prefill_s` after a request
starts. Requests wait in one FIFO (the router's queue); a request still waiting after `timeout_s`
is rejected. The autoscaler runs every `tick_s` like Ray Serve's: desired = ceil(ongoing / target),
held for `upscale_delay_s` / `downscale_delay_s` before acting, clamped to [min, max]; from zero it
starts one replica at once. The predictive policy also never goes below a schedule looked up
`lead_s` ahead.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from fleet.schedule import Schedule


@dataclass(frozen=True)
class ReplicaModel:
    cold_start_s: float
    slots: int
    service_s: float
    prefill_s: float

    @property
    def rate(self) -> float:
        """Requests per second one busy replica completes."""
        return self.slots / self.service_s


@dataclass(frozen=True)
class Policy:
    name: str
    min_replicas: int
    max_replicas: int
    target_ongoing: float
    upscale_delay_s: float = 3.0
    downscale_delay_s: float = 30.0
    schedule: Schedule | None = None
    lead_s: float = 0.0


@dataclass(frozen=True)
class Trace:
    quiet_rate: float
    burst_factor: float = 10.0
    quiet_s: float = 120.0
    burst_s: float = 60.0
    tail_s: float = 120.0
    seed: int = 0

    @property
    def burst_start(self) -> float:
        return self.quiet_s

    @property
    def duration(self) -> float:
        return self.quiet_s + self.burst_s + self.tail_s

    def arrivals(self) -> list[float]:
        rng = random.Random(self.seed)
        t, out = 0.0, []
        while True:
            burst = self.quiet_s <= t < self.quiet_s + self.burst_s
            t += rng.expovariate(self.quiet_rate * (self.burst_factor if burst else 1.0))
            if t >= self.duration:
                return out
            out.append(t)


@dataclass
class Result:
    policy: str
    ttft: list[float | None] = field(default_factory=list)  # None: rejected
    arrivals: list[float] = field(default_factory=list)
    replicas: list[tuple[float, int, int]] = field(default_factory=list)  # (t, ready, starting)
    replica_seconds: float = 0.0


def simulate(trace: Trace, model: ReplicaModel, policy: Policy, timeout_s: float = 30.0,
             tick_s: float = 0.1) -> Result:
    arrivals = trace.arrivals()
    res = Result(policy.name, [None] * len(arrivals), arrivals)
    ready, free = policy.min_replicas, policy.min_replicas * model.slots
    starting: list[float] = []  # ready times of replicas being started
    waiting: list[int] = []  # request indices, FIFO
    finishing: list[float] = []  # heap of slot release times
    running = 0
    next_arrival, t = 0, 0.0
    want_since: tuple[int, float] | None = None  # (direction, since when the desire held)
    end = trace.duration + timeout_s
    while t < end or waiting or running:
        # releases, new replicas, arrivals up to t
        while finishing and finishing[0] <= t:
            heapq.heappop(finishing)
            running, free = running - 1, free + 1
        for ready_at in [s for s in starting if s <= t]:
            starting.remove(ready_at)
            ready, free = ready + 1, free + model.slots
        while next_arrival < len(arrivals) and arrivals[next_arrival] <= t:
            waiting.append(next_arrival)
            next_arrival += 1
        waiting = [i for i in waiting if t - arrivals[i] < timeout_s]  # the rest gave up: rejected
        while waiting and free > 0 and ready > 0:
            i = waiting.pop(0)
            res.ttft[i] = t - arrivals[i] + model.prefill_s
            heapq.heappush(finishing, t + model.service_s)
            running, free = running + 1, free - 1
        # the autoscaler
        current = ready + len(starting)
        desired = _desired(policy, t, running + len(waiting), current)
        direction = (desired > current) - (desired < current)
        if direction == 0:
            want_since = None
        elif want_since is None or want_since[0] != direction:
            want_since = (direction, t)
        delay = policy.upscale_delay_s if direction > 0 else policy.downscale_delay_s
        if direction and (current == 0 or t - want_since[1] >= delay):
            if direction > 0:
                starting += [t + model.cold_start_s] * (desired - current)
            else:
                drop = min(current - desired, ready - math.ceil(running / model.slots))  # idle ones only
                if drop > 0:
                    ready, free = ready - drop, free - drop * model.slots
            want_since = None
        res.replica_seconds += (ready + len(starting)) * tick_s
        res.replicas.append((t, ready, len(starting)))
        t += tick_s
        if t > end + 600:  # a policy that never serves what is left
            break
    return res


def _desired(policy: Policy, now: float, ongoing: int, current: int) -> int:
    reactive = math.ceil(ongoing / policy.target_ongoing) if ongoing else 0
    if policy.schedule is not None:
        reactive = max(reactive, policy.schedule.planned(now, policy.lead_s))
    return max(policy.min_replicas, min(policy.max_replicas, reactive))


def summarize_result(res: Result, slo_ttft_s: float) -> dict:
    from serving.loadgen.stats import summarize

    served = [x for x in res.ttft if x is not None]
    return {
        "policy": res.policy, "requests": len(res.ttft), "rejected": len(res.ttft) - len(served),
        "over_slo": sum(1 for x in served if x > slo_ttft_s), "ttft_s": summarize(served),
        "replica_seconds": res.replica_seconds, "max_replicas": max((r + s for _, r, s in res.replicas), default=0),
    }
