"""Power of one gate, closed form: the task gates (non-inferiority on paired item differences, the flip model),
the safety gates (pooled rates, z = 0), the long-context gates (binomial probes) and the fidelity gates (at the
measured effect), and the policy-wide product. The reasoning is in gates.judging.power's docstring; the speed gates'
power is simulated (gates.judging.power_speed), sample-size planning is gates.judging.power_plan and the figures on
gate results and reports are gates.judging.power_report."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist

DEFAULT_FLIP_RATE = 0.10  # per-item answer changes of a harmless variant when none was measured (docs/gates.md)
REFUSAL_POWER = 0.80
CI_ALPHA = 0.05  # evals.compare's default: the gates judge 95 % CIs
_NORMAL = NormalDist()
_Z95 = _NORMAL.inv_cdf(1 - CI_ALPHA / 2)


@dataclass(frozen=True)
class GatePower:
    task: str
    n: int
    max_drop: float
    sd: float  # per-item sd of the paired difference of a harmless variant
    flip_rate: float | None  # None: a continuous metric, sd from its CI
    harmless_pass: float  # P(a variant equal to the baseline passes this gate)
    refusal80_drop: float  # the drop this gate refuses with probability REFUSAL_POWER
    underpowered: bool = False

    def line(self) -> str:
        source = f"flip rate {self.flip_rate:.3g}" if self.flip_rate is not None else f"item sd {self.sd:.3g}"
        return (f"harmless-pass {self.harmless_pass:.3f}, refuses a drop of {self.refusal80_drop:.3g} with "
                f"{REFUSAL_POWER:.0%} probability (n={self.n}, {source})")


def z_two_sided(alpha: float = CI_ALPHA) -> float:
    return _Z95 if alpha == CI_ALPHA else _NORMAL.inv_cdf(1 - alpha / 2)


def item_sd(flip_rate: float, drop: float = 0.0) -> float:
    """sd of the per-item paired difference under the flip model (binary tasks)."""
    if not 0.0 <= flip_rate <= 1.0:
        raise ValueError(f"flip_rate must be a fraction in [0, 1], got {flip_rate}")
    return math.sqrt(max(flip_rate + abs(drop) - drop * drop, 0.0))


def capped_flip_rate(flip_rate: float, baseline_score: float | None) -> float:
    """A harmless variant flips at most 2 * min(score, 1 - score) of the items (half each way)."""
    if baseline_score is None or not 0.0 <= baseline_score <= 1.0:
        return flip_rate
    return min(flip_rate, 2 * min(baseline_score, 1 - baseline_score))


def lattice_margin(n: int, max_drop: float) -> float:
    """max_drop with a half-step continuity correction: a binary task's deltas are multiples of 1/n and
    the gate admits a bound exactly at -max_drop, so a bound passes when it is above the half-step below
    the last multiple of 1/n within max_drop."""
    return (math.floor(max_drop * n + 1e-9) + 0.5) / n


def pass_probability(n: int, max_drop: float, drop: float = 0.0, flip_rate: float | None = None,
                     sd: float | None = None, alpha: float = CI_ALPHA) -> float:
    """P(the gate passes) for a variant `drop` worse than the baseline (0: harmless); a binary task
    gives `flip_rate`, a continuous one its per-item `sd`."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    spread = item_sd(flip_rate, drop) if flip_rate is not None else sd
    if spread is None or spread < 0:
        raise ValueError("give a flip_rate (binary task) or a per-item sd >= 0 (continuous metric)")
    margin = (lattice_margin(n, max_drop) if flip_rate is not None else max_drop) - drop
    if spread == 0.0:
        return 1.0 if margin >= 0 else 0.0
    return _NORMAL.cdf(margin * math.sqrt(n) / spread - z_two_sided(alpha))


def refusal_drop(n: int, max_drop: float, flip_rate: float | None = None, sd: float | None = None,
                 power: float = REFUSAL_POWER, alpha: float = CI_ALPHA) -> float:
    """The smallest drop the gate refuses with probability `power` (0 when it refuses even a harmless
    variant that often). Closed form for a continuous metric; bisection under the flip model, where
    the spread grows with the drop."""
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    if flip_rate is None:
        if sd is None:
            raise ValueError("give a flip_rate (binary task) or a per-item sd (continuous metric)")
        drop = max_drop - (z_two_sided(alpha) - _NORMAL.inv_cdf(power)) * sd / math.sqrt(n)
        return max(drop, 0.0)
    if pass_probability(n, max_drop, 0.0, flip_rate, alpha=alpha) <= 1 - power:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(32):  # to 1e-9 of a score
        mid = (low + high) / 2
        if pass_probability(n, max_drop, mid, flip_rate, alpha=alpha) > 1 - power:
            low = mid
        else:
            high = mid
    return high


def gate_power(task: str, n: int, max_drop: float, flip_rate: float | None = None, sd: float | None = None,
               min_harmless_pass: float | None = None, alpha: float = CI_ALPHA) -> GatePower:
    harmless = pass_probability(n, max_drop, 0.0, flip_rate, sd, alpha)
    spread = item_sd(flip_rate) if flip_rate is not None else float(sd)
    return GatePower(task=task, n=n, max_drop=max_drop, sd=spread, flip_rate=flip_rate, harmless_pass=harmless,
                     refusal80_drop=refusal_drop(n, max_drop, flip_rate, sd, alpha=alpha),
                     underpowered=min_harmless_pass is not None and harmless < min_harmless_pass)


def safety_power(name: str, n: int, max_change: float, rate: float, flip_rate: float | None,
                 min_harmless_pass: float | None) -> GatePower:
    """A safety gate (a point difference of rates over n pooled items, no CI: z = 0) at the baseline's rate."""
    flips = capped_flip_rate(DEFAULT_FLIP_RATE if flip_rate is None else flip_rate, rate)
    return gate_power(name, n, max_change, flip_rate=flips, min_harmless_pass=min_harmless_pass, alpha=1.0)


def long_context_power(length: int, n: int, max_drop: float, baseline_accuracy: float,
                       min_harmless_pass: float | None) -> GatePower:
    """A long-context gate: each probe retrieved independently with the baseline's accuracy (binomial)."""
    p = min(max(baseline_accuracy, 0.0), 1.0)
    return gate_power(f"long_context/{length}", n, max_drop, flip_rate=2 * p * (1 - p),
                      min_harmless_pass=min_harmless_pass)


def fidelity_power(name: str, chunks: int, limit: float, point: float, ci_low: float, ci_high: float,
                   min_harmless_pass: float | None) -> GatePower:
    """A fidelity gate at its measured effect: P(CI high <= limit on `chunks` fresh chunks) if the true mean is
    `point`; the per-chunk sd from the recorded CI's width (normal approximation of the cluster bootstrap).
    `refusal80_drop` holds the true mean the gate refuses with REFUSAL_POWER probability."""
    se = max(ci_high - ci_low, 0.0) / (2 * _Z95)
    sd = se * math.sqrt(chunks)
    if se == 0.0:
        harmless = 1.0 if point <= limit else 0.0
    else:
        harmless = _NORMAL.cdf((limit - point) / se - _Z95)
    refused = limit - (_Z95 - _NORMAL.inv_cdf(REFUSAL_POWER)) * se
    return GatePower(name, chunks, limit, sd, None, harmless, refused,
                     min_harmless_pass is not None and harmless < min_harmless_pass)


def family_harmless_pass(powers: Sequence[GatePower]) -> float:
    """P(a harmless variant passes every gate), gates independent (disjoint items)."""
    return math.prod(p.harmless_pass for p in powers)


def flip_rates(comparison: Mapping) -> dict[str, float]:
    """Per task: (right->wrong + wrong->right) / n of one variant, from a compare.json."""
    rates: dict[str, float] = {}
    for row in comparison.get("rows", []):
        if row.get("binary") and row.get("n"):
            rates[row["task"]] = (len(row.get("lost", [])) + len(row.get("gained", []))) / row["n"]
    return rates


def _is_binary(task: str) -> bool:
    try:
        from evals.tasks import TASKS
    except ImportError:  # gates used without evals installed
        return True
    spec = TASKS.get(task)
    return spec is None or spec.binary


def task_powers(policy, variant: Mapping[str, float], baseline: Mapping[str, float],
                measured_flip_rates: Mapping[str, float] | None = None) -> dict[str, GatePower]:
    """The power of every task gate at its recorded n and baseline score (tasks without n: none)."""
    from gates import metric_names as M

    rates = measured_flip_rates or {}
    z = z_two_sided()
    powers: dict[str, GatePower] = {}
    for task in sorted(M.tasks_in(variant) | M.tasks_in(baseline)):
        n = variant.get(M.task_key(task, "n"), baseline.get(M.task_key(task, "n")))
        if not n:
            continue
        gate = policy.task_gate(task)
        if _is_binary(task):
            rate = capped_flip_rate(rates.get(task, DEFAULT_FLIP_RATE), baseline.get(M.task_score(task)))
            powers[task] = gate_power(task, int(n), gate.max_drop, flip_rate=rate,
                                      min_harmless_pass=policy.min_harmless_pass)
            continue
        low, high = variant.get(M.task_delta_ci_low(task)), variant.get(M.task_delta_ci_high(task))
        if low is not None and high is not None:
            sd = (high - low) / (2 * z) * math.sqrt(n)
            powers[task] = gate_power(task, int(n), gate.max_drop, sd=sd, min_harmless_pass=policy.min_harmless_pass)
    return powers


def _pooled(metric: str, base: Mapping[str, float], rates: Mapping[str, float]) -> tuple[int, float | None]:
    """The safety rate's pooled n over the refusal tasks scored by `metric`, and their n-weighted flip rate."""
    from gates import metric_names as M

    try:
        from evals.tasks import TASKS
    except ImportError:  # gates used without evals installed: no way to tell which tasks pool
        return 0, None
    sizes = {t: int(base[M.task_key(t, "n")]) for t in M.tasks_in(base)
             if t in TASKS and TASKS[t].metric == metric and base.get(M.task_key(t, "n"))}
    measured = {t: rates[t] for t in sizes if t in rates}
    weight = sum(sizes[t] for t in measured)
    return sum(sizes.values()), (sum(rates[t] * sizes[t] for t in measured) / weight if weight else None)


def family_powers(policy, variant: Mapping[str, float], base: Mapping[str, float],
                  measured_flip_rates: Mapping[str, float] | None = None) -> dict[str, GatePower]:
    """gate name -> power of every safety, fidelity and long-context gate whose inputs were recorded (the
    speed gates' are simulated: speed_powers)."""
    from gates import metric_names as M
    from gates.judging import fidelity_gates as G

    rates, out, floor = measured_flip_rates or {}, {}, policy.min_harmless_pass
    for key, limit, name, metric in (
            (M.SAFETY_REFUSAL_RATE, policy.refusal_rate_max_fall, "safety/refusal_rate/max_fall", "refusal_rate"),
            (M.SAFETY_OVER_REFUSAL_RATE, policy.over_refusal_rate_max_rise, "safety/over_refusal_rate/max_rise",
             "over_refusal_rate")):
        n, flips = _pooled(metric, base, rates)
        if limit is not None and n and key in base:
            out[name] = safety_power(name, n, limit, base[key], flips, floor)
    fid = policy.fidelity
    for key, limit, name in ((G.FIDELITY_KL, fid.max_kl, "fidelity/kl/max"),
                             (G.FIDELITY_FLIP_RATE, fid.max_flip_rate, "fidelity/flip_rate/max")):
        low, high = variant.get(G.ci_key(key, "low")), variant.get(G.ci_key(key, "high"))
        if limit is not None and low is not None and high is not None and key in variant:
            out[name] = fidelity_power(name, fid.chunks, limit, variant[key], low, high, floor)
    if policy.long_context.max_drop is not None:
        for length in G.probed_lengths(variant):
            n, acc = (variant.get(G.long_context_key(length, f)) for f in ("n", "baseline"))
            if n and acc is not None:
                gate = f"long_context/{length}/max_drop"
                out[gate] = replace(long_context_power(length, int(n), policy.long_context.max_drop, acc, floor),
                                    task=gate)
    return out
