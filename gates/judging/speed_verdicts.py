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

import math
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
                count_key: str, unit: str = "paired rounds") -> SpeedVerdict:
    """One speed gate over `key` and its CI bounds as recorded (a missing estimate: not measured)."""
    rule = f"{what}: 95% CI of the paired ratio vs min (pass above, fail below, uninformative across)"
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
                        f"{what} {estimate:.3g}x (95% CI {low:.3g}-{high:.3g}, {rounds}): {where}")


def release_verdicts(metrics: Mapping[str, float], decode_batches: Sequence[int], min_decode: float | None,
                     min_prefill: float | None) -> list[SpeedVerdict]:
    """The release's speed gates: decode at every operating point the policy names, and prefill."""
    out = []
    if min_decode is not None:
        for b in decode_batches:
            out.append(judge_ratio(metrics, M.decode_speedup(b), min_decode, f"serve/min_decode_speedup/b{b}",
                                   f"decode speedup at batch {b}", M.SERVE_SPEED_ROUNDS))
    if min_prefill is not None:
        out.append(judge_ratio(metrics, M.SERVE_PREFILL_SPEEDUP, min_prefill, "serve/min_prefill_speedup",
                               "prefill speedup", M.SERVE_SPEED_ROUNDS))
    return out


def canary_verdict(metrics: Mapping[str, float], min_speedup: float) -> SpeedVerdict:
    """The canary's: champion TPOT / challenger TPOT over paired windows of the replayed traffic."""
    return judge_ratio(metrics, M.CANARY_TPOT_SPEEDUP, min_speedup, "canary/min_tpot_speedup",
                       "challenger speedup over the champion (TPOT)", M.CANARY_SPEED_WINDOWS,
                       "paired windows")
