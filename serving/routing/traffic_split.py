"""The traffic split between model versions, one implementation for the canary router (serving/routing/router_state.py)
and the fleet ingress (fleet/traffic.py): weights, a pick sticky per user, promote and rollback, every change
recorded with its time and reason. Imports neither torch nor the engine, so a proxy can use it.

One rollback rule for both: a rollback takes the versions on trial (`canaries`) out. They get weight 0; the
others keep their weights, or get their configured ones back when a promote left them at 0; the champion is
the version that is not on trial. It needs no history, so it works before any promote (a canary whose
backend died) and a second rollback changes nothing. docs/serving.md says why this rule and not "restore the
previous weights".

The two users differ only in pick order (`order`): the versions' slices of [0, 1) are laid out in this
order. The router lays them out in its config's order, canary last, so the canary's users stay in it as its
weight grows; the fleet lays them out by name.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass


class TrafficError(ValueError):
    """A change the split cannot make (unknown version, nothing to roll back, no reason given)."""


class NoVersion(TrafficError):
    """Every version has weight 0: no request can be placed."""


def user_point(user: str) -> float:
    """A stable point in [0, 1) for a user: the same user lands in the same slice of the split."""
    digest = hashlib.sha256(user.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def pick(weights: dict[str, float], order: Sequence[str], point: float) -> str:
    """The version whose slice of the cumulative weights (laid out in `order`) holds `point`."""
    total = sum(weights.values())
    if total <= 0:
        raise NoVersion("every version has weight 0")
    names = [n for n in order if weights.get(n, 0.0) > 0]
    acc = 0.0
    for name in names:
        acc += weights[name] / total
        if point < acc:
            return name
    return names[-1]  # float rounding left the last sliver unassigned


@dataclass
class Change:
    """One recorded change of the split: what it was, why, and the weights before and after."""

    time: float  # time.time()
    action: str  # start | promote | rollback | weights
    reason: str
    weights_before: dict[str, float]
    weights: dict[str, float]
    champion: str

    def as_dict(self) -> dict:
        """The fleet's record of a change (the router writes its own, serving/routing/router_state.py)."""
        return {"time": self.time, "action": self.action, "weights": dict(self.weights), "champion": self.champion,
                "reason": self.reason, "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))}


class TrafficSplit:
    """Weights over versions, replaced (never mutated) on each change, so a reader sees old or new, never half.

    `canaries` are the versions on trial, the ones a rollback takes out; `champion` the version serving
    'everything else' (the one a promote makes). Changes need a non-empty reason; `history` keeps every
    change in order."""

    def __init__(self, weights: dict[str, float], *, champion: str, canaries: Collection[str],
                 order: Sequence[str] | None = None):
        if champion not in weights:
            raise TrafficError(f"champion {champion!r} is not one of {sorted(weights)}")
        unknown = set(canaries) - set(weights)
        if unknown:
            raise TrafficError(f"canaries {sorted(unknown)} are not among {sorted(weights)}")
        self.weights = dict(weights)
        self.configured = dict(weights)
        self.champion = champion
        self.canaries = frozenset(canaries)
        self.order = list(order) if order is not None else list(weights)
        self.history: list[Change] = []
        self.lock = threading.Lock()

    def pick(self, user: str | None, rng: random.Random | None = None) -> str:
        """The version for a request: a user's point on the cumulative weights (sticky); no user, a draw."""
        weights = self.weights  # one read: a change between requests takes effect on the next one
        return pick(weights, self.order, user_point(user) if user else (rng or random).random())

    def set_weights(self, weights: dict[str, float], reason: str, action: str = "weights") -> Change:
        with self.lock:
            return self._replace(dict(weights), self.champion, action, reason)

    def promote(self, version: str, reason: str, weight: float = 1.0) -> Change:
        """All traffic to `version` (at `weight`, the others 0), which becomes the champion."""
        if version not in self.weights:
            raise TrafficError(f"unknown version {version!r}; versions: {sorted(self.weights)}")
        with self.lock:
            return self._replace({n: weight if n == version else 0.0 for n in self.configured}, version,
                                 "promote", reason)

    def rollback(self, reason: str) -> Change:
        """The versions on trial to 0 (the module docstring states the rule)."""
        with self.lock:
            weights, champion = self._canaries_off()
            return self._replace(weights, champion, "rollback", reason)

    def record(self, action: str, reason: str) -> Change:
        """Record the current state (e.g. 'start') without changing it."""
        with self.lock:
            return self._replace(dict(self.weights), self.champion, action, reason)

    # ---- the rule ------------------------------------------------------------------------------
    def _canaries_off(self) -> tuple[dict[str, float], str]:
        if not self.canaries:
            raise TrafficError("nothing to roll back: no version is on trial")
        others = {n: self.weights.get(n, 0.0) for n in self.order if n not in self.canaries}
        if not others:
            raise TrafficError("rollback needs a version other than the canary")
        if sum(others.values()) <= 0:  # after a promote: back to the configured weights
            others = {n: self.configured.get(n, 0.0) for n in others}
        if sum(others.values()) <= 0:
            others = dict.fromkeys(others, 1.0)
        champion = self.champion if self.champion in others else max(others, key=others.__getitem__)
        return {**others, **dict.fromkeys(sorted(self.canaries), 0.0)}, champion

    def _replace(self, weights: dict[str, float], champion: str, action: str, reason: str) -> Change:
        if not reason or not reason.strip():
            raise TrafficError(f"{action} needs a reason (it is recorded with the time)")
        change = Change(time.time(), action, reason.strip(), dict(self.weights), dict(weights), champion)
        self.weights, self.champion = weights, champion
        self.history.append(change)
        return change
