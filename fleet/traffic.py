"""The traffic split between versions: weights, sticky per `user`, changed live and recorded."""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import asdict, dataclass, field


def user_point(user: str) -> float:
    """A stable point in [0, 1) for a user: the same user lands in the same slice of the split."""
    digest = hashlib.sha256(user.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass
class Change:
    time: float
    action: str  # start | promote | rollback | weights
    weights: dict[str, float]
    champion: str
    reason: str

    def as_dict(self) -> dict:
        return {**asdict(self), "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))}


@dataclass
class TrafficState:
    weights: dict[str, float]
    champion: str
    history: list[Change] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.weights, self.champion)
        if not self.history:
            self.history.append(Change(time.time(), "start", dict(self.weights), self.champion, "fleet up"))

    def pick(self, user: str | None, rng: random.Random | None = None) -> str:
        """The version for this request: a user's point on the cumulative weights (sticky); no user, a draw."""
        point = user_point(user) if user else (rng or random).random()
        total = sum(self.weights.values())
        acc = 0.0
        names = sorted(n for n, w in self.weights.items() if w > 0)
        for name in names:
            acc += self.weights[name] / total
            if point < acc:
                return name
        return names[-1]

    def set_weights(self, weights: dict[str, float], reason: str, action: str = "weights") -> Change:
        unknown = set(weights) - set(self.weights)
        if unknown:
            raise ValueError(f"unknown versions {sorted(unknown)}; versions: {sorted(self.weights)}")
        new = {n: float(weights.get(n, 0.0)) for n in self.weights}
        _check(new, self.champion)
        self.weights = new
        return self._record(action, reason)

    def promote(self, version: str, reason: str) -> Change:
        """All traffic to `version`, which becomes the champion; the previous state stays in the history."""
        if version not in self.weights:
            raise ValueError(f"unknown version {version!r}; versions: {sorted(self.weights)}")
        self.champion = version
        self.weights = {n: (1.0 if n == version else 0.0) for n in self.weights}
        return self._record("promote", reason)

    def rollback(self, reason: str) -> Change:
        """Back to the weights and champion in force before the latest promote (or weight change)."""
        if len(self.history) < 2:
            raise ValueError("nothing to roll back: no promote or weight change since the fleet started")
        current = self.history[-1]
        previous = next((c for c in reversed(self.history[:-1])
                         if (c.weights, c.champion) != (current.weights, current.champion)), None)
        if previous is None:
            raise ValueError("nothing to roll back: every recorded state is the current one")
        self.weights, self.champion = dict(previous.weights), previous.champion
        return self._record("rollback", reason)

    def snapshot(self) -> dict:
        return {"weights": dict(self.weights), "champion": self.champion,
                "history": [c.as_dict() for c in self.history]}

    def _record(self, action: str, reason: str) -> Change:
        if not reason or not reason.strip():
            raise ValueError(f"{action} needs a reason (it is recorded with the time)")
        change = Change(time.time(), action, dict(self.weights), self.champion, reason.strip())
        self.history.append(change)
        return change


def _check(weights: dict[str, float], champion: str) -> None:
    if champion not in weights:
        raise ValueError(f"champion {champion!r} is not one of {sorted(weights)}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
