"""The fleet ingress's traffic split: weights, sticky per `user`, changed live and recorded.

The split itself is serving/routing/traffic_split.py (shared with the canary router); the fleet's rules are that
versions are laid out by name, weights are checked here (known versions, non-negative, a positive sum), and the
versions on trial, the ones a rollback takes out, are every version but the champion the fleet started with.
"""

from __future__ import annotations

from serving.routing.traffic_split import Change, TrafficSplit, user_point

__all__ = ["Change", "TrafficState", "user_point"]


class TrafficState(TrafficSplit):
    def __init__(self, weights: dict[str, float], champion: str):
        _check(weights, champion)
        super().__init__(weights, champion=champion, canaries=[n for n in weights if n != champion],
                         order=sorted(weights))
        self.record("start", "fleet up")

    def set_weights(self, weights: dict[str, float], reason: str, action: str = "weights") -> Change:
        unknown = set(weights) - set(self.weights)
        if unknown:
            raise ValueError(f"unknown versions {sorted(unknown)}; versions: {sorted(self.weights)}")
        new = {n: float(weights.get(n, 0.0)) for n in self.weights}
        _check(new, self.champion)
        return super().set_weights(new, reason, action)

    def snapshot(self) -> dict:
        return {"weights": dict(self.weights), "champion": self.champion,
                "history": [c.as_dict() for c in self.history]}


def _check(weights: dict[str, float], champion: str) -> None:
    if champion not in weights:
        raise ValueError(f"champion {champion!r} is not one of {sorted(weights)}")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
