"""How long a step takes as a function of its tokens, learned from the steps the engine runs.

seconds ~= fixed + per_token * tokens, fitted by exponentially weighted least squares over recent
steps. The scheduler uses it to size prefill chunks while several tenants share the engine: the
chunk is as large as it can be without making everyone's next decode token more than `slack`
slower than a step without it (Sarathi-Serve's token budget, derived from the machine instead of
a constant: on a GPU prefill tokens are cheap and the chunk stays large, on a CPU it shrinks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCostModel:
    decay: float = 0.98  # weight of the history per new step: ~50 steps of memory
    min_token_spread: float = 16.0  # fit only once steps of clearly different sizes were seen
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.weight = d * self.weight + 1.0
        self.sum_x = d * self.sum_x + tokens
        self.sum_y = d * self.sum_y + seconds
        self.sum_xx = d * self.sum_xx + tokens * tokens
        self.sum_xy = d * self.sum_xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps seen say too little."""
        if self.weight < 2:
            return None
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        var_x = self.sum_xx / self.weight - mean_x * mean_x
        if var_x < self.min_token_spread**2:
            return None
        per_token = (self.sum_xy / self.weight - mean_x * mean_y) / var_x
        if per_token <= 0:
            return None
        return max(0.0, mean_y - per_token * mean_x), per_token

    def tokens_within(self, base_tokens: int, slack: float) -> int | None:
        """Extra tokens a step of `base_tokens` can take while staying within (1 + slack) of its time."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return int(slack * (fixed + per_token * base_tokens) / per_token + 1e-6)  # 14.9999... is 15
