"""Speed judged like accuracy: a paired ratio with a confidence interval, and three outcomes.

A speed ratio (variant tok/s / baseline tok/s, or champion TPOT / challenger TPOT) is measured in paired
rounds: within a round both models run on the same machine in the same minutes, so a drift of the
machine's speed falls on both and cancels in the round's ratio. The ratios of the rounds are averaged on
the log scale (a geometric mean: 2x and 0.5x average to 1x) with a Student-t 95 % interval, and the gate
has three outcomes:

- the whole CI at or above the threshold: `pass`;
- the whole CI below it: `fail`;
- the CI straddling it: `uninformative` (the machine's noise decides). The policy's `serving` family in
  `sensitivity` says whether that blocks auto-approval (the default: `block`; a noisy machine must never
  promote on speed).

Used by `gates.records.evaluation` (release and canary gates) and by the flow that measures the rounds.
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gates import metric_names as M

PASS, FAIL, UNINFORMATIVE = "pass", "fail", "uninformative"
CONFIDENCE = 0.95
_EPS = 1e-9
# two-sided 95 % Student-t quantiles by degrees of freedom (no scipy needed); beyond 30 the normal's
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
         18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}


def t_quantile(df: int) -> float:
    """The two-sided 95 % t quantile at `df` degrees of freedom (the table's next smaller df: conservative)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    if df > 30:
        return 1.96
    return _T975[max(d for d in _T975 if d <= df)]


@dataclass(frozen=True)
class RatioCI:
    estimate: float  # geometric mean of the per-round ratios
    low: float
    high: float
    n: int  # paired rounds (or windows)

    def metrics(self, key: str) -> dict[str, float]:
        return {key: self.estimate, M.ci(key, "ci_low"): self.low, M.ci(key, "ci_high"): self.high}


def ratio_ci(ratios: Sequence[float]) -> RatioCI:
    """Geometric mean of paired ratios and its 95 % t interval on the log scale (at least 2 ratios)."""
    if len(ratios) < 2:
        raise ValueError(f"a confidence interval needs at least 2 paired ratios, got {len(ratios)}")
    if any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"ratios must be finite and > 0, got {list(ratios)}")
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return RatioCI(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))


def outcome(low: float, high: float, threshold: float) -> str:
    """pass: the whole CI >= threshold; fail: the whole CI below it; else uninformative."""
    if low >= threshold - _EPS:
        return PASS
    if high < threshold - _EPS:
        return FAIL
    return UNINFORMATIVE


@dataclass(frozen=True)
class SpeedVerdict:
    name: str
    rule: str
    threshold: float
    observed: float | None  # the point estimate (None: not measured)
    verdict: str  # pass | fail | uninformative | "" (not measured: fails)
    reason: str


def judge_ratio(metrics: Mapping[str, float], key: str, threshold: float, name: str, what: str,
                count_key: str, unit: str = "paired rounds", level_key: str | None = None) -> SpeedVerdict:
    """One speed gate over `key` and its CI bounds as recorded (a missing estimate: not measured); where
    `level_key` is recorded the CI is a sequential look's, at that adjusted level."""
    level = metrics.get(level_key) if level_key else None
    label = f"{100 * level:.1f}% look-adjusted CI" if level is not None else "95% CI"
    rule = f"{what}: {label} of the paired ratio vs min (pass above, fail below, uninformative across)"
    if key not in metrics:
        return SpeedVerdict(name, rule, threshold, None, "", f"not measured: {key} not recorded")
    estimate, n = metrics[key], metrics.get(count_key)
    rounds = f"{int(n)} {unit}" if n is not None else f"{unit}: count unknown"
    low, high = metrics.get(M.ci(key, "ci_low")), metrics.get(M.ci(key, "ci_high"))
    if low is None or high is None:
        return SpeedVerdict(name, rule, threshold, estimate, UNINFORMATIVE,
                            f"{what} {estimate:.3g}x with no CI ({rounds}; at least 2 are needed)")
    verdict = outcome(low, high, threshold)
    where = {PASS: f"whole CI >= {threshold:.3g}", FAIL: f"whole CI < {threshold:.3g}",
             UNINFORMATIVE: f"CI straddles {threshold:.3g}: the machine's noise decides"}[verdict]
    return SpeedVerdict(name, rule, threshold, estimate, verdict,
                        f"{what} {estimate:.3g}x ({label} {low:.3g}-{high:.3g}, {rounds}): {where}")


def _point_gate(metrics: Mapping[str, float], point: str, key: str, threshold: float, name: str,
                what: str) -> SpeedVerdict:
    """A release speed gate: the point's own rounds and CI level where recorded (sequential rounds)."""
    rounds = M.speed_point(point, "rounds")
    return judge_ratio(metrics, key, threshold, name, what, rounds if rounds in metrics else M.SERVE_SPEED_ROUNDS,
                       level_key=M.speed_point(point, "ci_level"))


def release_verdicts(metrics: Mapping[str, float], decode_batches: Sequence[int], min_decode: float | None,
                     min_prefill: float | None) -> list[SpeedVerdict]:
    """The release's speed gates: decode at every batch the policy names, at the long-context point where it
    was timed (KV-quantized variants), and prefill."""
    out = []
    if min_decode is not None:
        for b in decode_batches:
            out.append(_point_gate(metrics, f"decode_b{b}", M.decode_speedup(b), min_decode,
                                   f"serve/min_decode_speedup/b{b}", f"decode speedup at batch {b}"))
        for key in sorted(k for k in metrics if _LONG_KEY.match(k)):
            b = int(_LONG_KEY.match(key).group(1))
            out.append(_point_gate(metrics, f"long_decode_b{b}", key, min_decode,
                                   f"serve/min_decode_speedup/long_b{b}", f"long-context decode speedup at batch {b}"))
    if min_prefill is not None:
        out.append(_point_gate(metrics, "prefill", M.SERVE_PREFILL_SPEEDUP, min_prefill, "serve/min_prefill_speedup",
                               "prefill speedup"))
    return out


_LONG_KEY = re.compile(r"^serve/long_decode_speedup_b(\d+)$")


def canary_verdict(metrics: Mapping[str, float], min_speedup: float) -> SpeedVerdict:
    """The canary's: champion TPOT / challenger TPOT over paired windows of the replayed traffic."""
    return judge_ratio(metrics, M.CANARY_TPOT_SPEEDUP, min_speedup, "canary/min_tpot_speedup",
                       "challenger speedup over the champion (TPOT)", M.CANARY_SPEED_WINDOWS,
                       "paired windows")


# ---- group-sequential rounds ------------------------------------------------------------------------
# The release times rounds until each (variant, point) reaches a decision: a look every `look_every`
# rounds, alpha spent across the looks by a Lan–DeMets spending function, and at each look the repeated
# confidence interval (Jennison & Turnbull) at that look's adjusted level. The interval's bounds against the
# minimum stop the point (pass / fail) exactly as `outcome` judges a fixed-round CI, so the gate that later
# reads the recorded CI reaches the verdict the loop stopped on.

CONTINUE = "continue"
SPENDING_RULES = ("pocock", "obrien-fleming")
_NORMAL = statistics.NormalDist()


def spent(rule: str, fraction: float, alpha: float) -> float:
    """Two-sided alpha spent by information fraction `fraction` (Lan & DeMets 1983)."""
    t = min(max(fraction, 0.0), 1.0)
    if rule == "pocock":  # alpha * ln(1 + (e - 1) t): about even per look, so a clear effect stops early
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    if rule == "obrien-fleming":  # 2 - 2 Phi(z / sqrt t): almost nothing early, nearly all kept for the last look
        return 0.0 if t == 0 else 2.0 * (1.0 - _NORMAL.cdf(_NORMAL.inv_cdf(1.0 - alpha / 2.0) / math.sqrt(t)))
    raise ValueError(f"unknown alpha-spending rule {rule!r} (known: {', '.join(SPENDING_RULES)})")


def _exit_mass(density, grid, step: float, bound: float) -> float:
    """Mass of a gridded density outside (-bound, bound), the cumulative interpolated between grid points."""
    import numpy as np

    cum = np.concatenate([[0.0], np.cumsum(density) * step])
    edges = np.concatenate([grid - step / 2, [grid[-1] + step / 2]])
    inside = np.interp(bound, edges, cum) - np.interp(-bound, edges, cum)
    return float(cum[-1] - inside)


@functools.lru_cache(maxsize=256)
def boundaries(fractions: tuple[float, ...], alpha: float, rule: str) -> tuple[float, ...]:
    """The z boundary of every look at these information fractions (a final look at 1.0 spends the rest), by the
    Armitage–McPherson–Rowe recursion on a grid of the score process B(t) ~ N(0, t)."""
    import numpy as np

    step, grid = 0.01, np.arange(-10.0, 10.0 + 1e-9, 0.01)
    out: list[float] = []
    density, prev_t, prev_spent = None, 0.0, 0.0
    for t in fractions:
        if not t > prev_t:
            raise ValueError(f"information fractions must increase, got {fractions}")
        target = spent(rule, t, alpha) - prev_spent  # at t = 1 both rules have spent exactly alpha
        sd = math.sqrt(t - prev_t)
        kernel = np.exp(-0.5 * ((grid[:, None] - grid[None, :]) / sd) ** 2) / (sd * math.sqrt(2 * math.pi))
        new = (np.exp(-0.5 * grid ** 2 / t) / math.sqrt(2 * math.pi * t) if density is None
               else kernel @ density * step)
        lo, hi = 0.0, 12.0 * math.sqrt(t)
        for _ in range(60):  # bisection on the score bound whose exit mass is this look's spend
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _exit_mass(new, grid, step, mid) > target else (lo, mid)
        bound = (lo + hi) / 2
        out.append(bound / math.sqrt(t))
        density = np.where(np.abs(grid) < bound, new, 0.0)
        prev_t, prev_spent = t, prev_spent + max(target, 0.0)
    return tuple(out)


def _t_inside(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer df (the closed-form finite series)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, 0.0
    if df % 2:
        term, j = 1.0, 3
        while j <= df - 1:  # 1 + 2/3 c^2 + (2*4)/(3*5) c^4 + ...
            s, term, j = s + term, term * c2 * (j - 1) / j, j + 2
        return (2 / math.pi) * (theta + (math.sin(theta) * math.cos(theta) * s if df > 1 else 0.0))
    term, j = 1.0, 2
    while j <= df:  # 1 + 1/2 c^2 + (1*3)/(2*4) c^4 + ...
        s, term, j = s + term, term * c2 * (j - 1) / j, j + 2
    return math.sin(theta) * s


@functools.lru_cache(maxsize=4096)
def t_two_sided(level: float, df: int) -> float:
    """The t with P(|T_df| < t) = level (exact, by bisection on the angle)."""
    if df < 1 or not 0 < level < 1:
        raise ValueError(f"a t quantile needs df >= 1 and a level in (0, 1), got {df}, {level}")
    lo, hi = 0.0, math.pi / 2
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_inside(math.sqrt(df) * math.tan(mid), df) < level else (lo, mid)
    return math.sqrt(df) * math.tan((lo + hi) / 2)


@dataclass(frozen=True)
class SequentialDesign:
    """Looks every `look_every` paired rounds up to `max_rounds`, alpha spent by `spending`."""

    look_every: int = 5
    max_rounds: int = 20
    alpha: float = 1.0 - CONFIDENCE
    spending: str = "pocock"

    def __post_init__(self) -> None:
        if self.look_every < 3 or self.max_rounds < self.look_every:
            raise ValueError(f"looks need >= 3 rounds each and max_rounds >= look_every, got {self}")
        spent(self.spending, 1.0, self.alpha)  # names a known rule

    def is_look(self, rounds: int) -> bool:
        return rounds % self.look_every == 0 or rounds >= self.max_rounds

    def level(self, rounds: int, final: bool) -> float:
        """The confidence level of the repeated CI at a look after `rounds` (final: spends what is left)."""
        looks = [n for n in range(self.look_every, rounds, self.look_every)] + [rounds]
        final = final or rounds >= self.max_rounds
        fractions = tuple(n / self.max_rounds if not (final and n == rounds) else 1.0 for n in looks)
        if final and len(fractions) > 1 and fractions[-2] >= 1.0:
            raise ValueError(f"no look after the last planned one: {looks}")
        z = boundaries(fractions, self.alpha, self.spending)[-1]
        return 1.0 - 2.0 * (1.0 - _NORMAL.cdf(z))


@dataclass(frozen=True)
class Look:
    ci: RatioCI
    level: float  # the adjusted confidence level of `ci`
    decision: str  # pass | fail | continue | uninformative (final look, CI straddling)


def sequential_look(ratios: Sequence[float], threshold: float | None, design: SequentialDesign,
                    final: bool = False) -> Look:
    """One look at a point's paired ratios: the repeated CI at the look's level, judged against `threshold`
    (None: no gate, the point stops at its first look)."""
    n = len(ratios)
    if n < 2 or any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"a look needs >= 2 finite ratios > 0, got {list(ratios)}")
    level = design.level(n, final)
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.fmean(logs), t_two_sided(level, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    ci = RatioCI(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)
    verdict = PASS if threshold is None else outcome(ci.low, ci.high, threshold)
    if verdict == UNINFORMATIVE and not (final or n >= design.max_rounds):
        verdict = CONTINUE
    return Look(ci, level, verdict)
