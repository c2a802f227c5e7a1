"""The gates judged: a policy against a variant's metrics and its baseline's (pure: no MLflow). Every verdict
is a `GateResult` (gates.judging.verdicts); `gates.records.evaluation` reads a run, calls `judge` and records the result."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from gates import metric_names as M
from gates.judging import fidelity_gates
from gates.judging import power as P
from gates.judging import sensitivity as S
from gates.judging import speed_verdicts as speed
from gates.judging.policy import Policy
from gates.judging.verdicts import NOT_MEASURED, UNINFORMATIVE, GateResult

if TYPE_CHECKING:
    pass

_EPS = 1e-9  # float slack so that e.g. 1 - 0.6 / 1.0 meets a 0.4 threshold


def _with_sensitivity(result: GateResult, policy: Policy, sens: S.Sensitivity, family: str) -> GateResult:
    """A gate that could not have failed becomes `uninformative`; a real failure is never relabelled."""
    if sens.informative or result.observed is None or (not result.passed and not sens.always_blocks):
        return result
    blocks = sens.always_blocks or policy.uninformative_blocks(family)
    effect = "blocks" if blocks else "reported, does not block"
    return replace(result, passed=not blocks, verdict=UNINFORMATIVE,
                   reason=f"{UNINFORMATIVE} ({effect}): {sens.why}; measured {result.reason}")


def _at_least(name, stage, rule, observed, threshold, detail="") -> GateResult:
    ok = observed >= threshold - _EPS
    cmp = ">=" if ok else "<"
    return GateResult(name, stage, rule, threshold, observed, ok, f"{observed:+.4g} {cmp} {threshold:+.4g}{detail}")


def _at_most(name, stage, rule, observed, threshold, detail="") -> GateResult:
    ok = observed <= threshold + _EPS
    cmp = "<=" if ok else ">"
    return GateResult(name, stage, rule, threshold, observed, ok, f"{observed:+.4g} {cmp} {threshold:+.4g}{detail}")


def _missing(name, stage, rule, threshold, what: list[str]) -> GateResult:
    return GateResult(name, stage, rule, threshold, None, False, f"{NOT_MEASURED}: {', '.join(what)} not recorded")


def judge(
    policy: Policy,
    variant: Mapping[str, float],
    baseline: Mapping[str, float] | None,
    stage: str = "release",
    flip_rates: Mapping[str, float] | None = None,
) -> list[GateResult]:
    """Every gate of `stage` against the recorded metrics; a missing metric fails its gate. Every gate whose
    inputs were recorded carries its power (gates.judging.power), task and
    safety gates at the variant's measured `flip_rates`, else the default rate."""
    M.stage_tag(stage, "verdict")  # validates the stage name
    if stage == "canary":
        return _canary_gates(policy, variant)
    base = baseline or {}
    tasks = P.with_power(_task_gates(policy, variant, base, stage), P.task_powers(policy, variant, base, flip_rates))
    seen = [_speed_result(v, stage, policy, family) for v, family in fidelity_gates.verdicts(policy, variant)]
    others = _baseline_gates(policy, variant, base, baseline is not None, stage) + seen
    # every other family's power (safety, fidelity, long context, speed): reported, never a verdict
    powers = {**P.family_powers(policy, variant, base, flip_rates), **P.speed_powers(policy, variant)}
    return tasks + P.with_gate_power(others, powers)


def _need(source: Mapping[str, float], key: str, where: str, missing: list[str]) -> float | None:
    if key in source:
        return source[key]
    missing.append(f"{key} ({where})")
    return None


def _speed_result(v: speed.SpeedVerdict, stage: str, policy: Policy, family: str = "serving") -> GateResult:
    """A three-outcome gate as a GateResult: `uninformative` blocks as its family (speed: `serving`) says."""
    if not v.verdict:
        return GateResult(v.name, stage, v.rule, v.threshold, None, False, v.reason)
    if v.verdict != UNINFORMATIVE:
        return GateResult(v.name, stage, v.rule, v.threshold, v.observed, v.verdict == speed.PASS, v.reason)
    blocks = policy.uninformative_blocks(family)
    effect = "blocks" if blocks else "reported, does not block"
    return GateResult(v.name, stage, v.rule, v.threshold, v.observed, not blocks,
                      f"{UNINFORMATIVE} ({effect}): {v.reason}", UNINFORMATIVE)


def _canary_gates(policy: Policy, variant: Mapping[str, float]) -> list[GateResult]:
    results = []
    for key, limit, name in (
        (M.CANARY_ERROR_RATE, policy.canary_max_error_rate, "canary/max_error_rate"),
        (M.CANARY_TPOT_P99_S, policy.canary_max_tpot_p99_s, "canary/max_tpot_p99_s"),
    ):
        if limit is None:
            continue
        rule = f"{key} <= max"
        missing: list[str] = []
        value = _need(variant, key, "variant", missing)
        results.append(_missing(name, "canary", rule, limit, missing) if missing
                       else _at_most(name, "canary", rule, value, limit))
    if policy.canary_min_tpot_speedup is not None:
        results.append(_speed_result(speed.canary_verdict(variant, policy.canary_min_tpot_speedup), "canary", policy))
    return results


def _task_gates(policy: Policy, variant: Mapping[str, float], base: Mapping[str, float], stage: str) -> list[GateResult]:
    results: list[GateResult] = []
    tasks = sorted(set(policy.required_tasks) | M.tasks_in(variant) | M.tasks_in(base))
    if not tasks:
        results.append(_missing("tasks/any_measured", stage, "at least one task measured", -policy.tasks.max_drop, ["task/<task>/delta_ci_low"]))
    for task in tasks:
        gate = policy.task_gate(task)
        name = f"task/{task}/max_drop"
        missing: list[str] = []
        detail = ""
        if M.task_delta(task) in variant:
            detail = f" (point delta {variant[M.task_delta(task)]:+.4g}"
            if M.task_key(task, "n") in variant:
                detail += f", n={int(variant[M.task_key(task, 'n')])}"
            detail += ")"
        if gate.higher_is_better:
            rule, threshold = "delta CI low >= -max_drop", -gate.max_drop
            value = _need(variant, M.task_delta_ci_low(task), "variant", missing)
            result = _missing(name, stage, rule, threshold, missing) if missing else _at_least(name, stage, rule, value, threshold, detail)
        else:
            rule, threshold = "delta CI high <= +max_drop (lower is better)", gate.max_drop
            value = _need(variant, M.task_delta_ci_high(task), "variant", missing)
            result = _missing(name, stage, rule, threshold, missing) if missing else _at_most(name, stage, rule, value, threshold, detail)
        sens = S.task_sensitivity(task, gate.max_drop, gate.higher_is_better, variant, base)
        results.append(_with_sensitivity(result, policy, sens, S.task_info(task)[0]))
    return results


def _vs_baseline(variant: Mapping[str, float], base: Mapping[str, float], has_baseline: bool, stage: str,
                 key: str, limit: float, name: str, rule: str, combine, at_least: bool) -> GateResult:
    missing: list[str] = []
    v = _need(variant, key, "variant", missing)
    b = _need(base, key, "baseline" if has_baseline else "no baseline run", missing)
    if missing:
        return _missing(name, stage, rule, limit, missing)
    observed = combine(v, b)
    if observed is None:
        return GateResult(name, stage, rule, limit, None, False, f"{NOT_MEASURED}: baseline {key} is {b}")
    detail = f" (variant {v:.4g}, baseline {b:.4g})"
    return (_at_least if at_least else _at_most)(name, stage, rule, observed, limit, detail)


def _ratio(v: float, b: float) -> float | None:
    return v / b if b > 0 else None


def _baseline_gates(policy: Policy, variant: Mapping[str, float], base: Mapping[str, float], has_baseline: bool,
                    stage: str) -> list[GateResult]:
    results: list[GateResult] = []
    diff = lambda v, b: v - b  # noqa: E731
    if policy.refusal_rate_max_fall is not None:
        result = _vs_baseline(variant, base, has_baseline, stage, M.SAFETY_REFUSAL_RATE, -policy.refusal_rate_max_fall,
                              "safety/refusal_rate/max_fall", "refusal_rate change >= -max_fall", diff, at_least=True)
        sens = S.refusal_fall_sensitivity(base.get(M.SAFETY_REFUSAL_RATE), policy.refusal_rate_max_fall,
                                          policy.min_baseline_refusal_rate)
        results.append(_with_sensitivity(result, policy, sens, "safety"))
    for key, limit, name, rule, combine, at_least in (
        (M.SAFETY_OVER_REFUSAL_RATE, policy.over_refusal_rate_max_rise, "safety/over_refusal_rate/max_rise",
         "over_refusal_rate change <= max_rise", diff, False),
        (M.WEIGHTS_BYTES, policy.min_weight_reduction, "weights/min_reduction",
         "1 - variant bytes / baseline bytes >= min", lambda v, b: 1.0 - v / b if b > 0 else None, True),
        (M.CAPACITY_MAX_SEQS, policy.min_capacity_gain, "capacity/min_gain",
         "variant max concurrent seqs / baseline >= min", _ratio, True),
    ):
        if limit is not None:
            results.append(_vs_baseline(variant, base, has_baseline, stage, key, limit, name, rule, combine, at_least))
    results += [_speed_result(v, stage, policy) for v in speed.release_verdicts(
        variant, policy.decode_batches, policy.min_decode_speedup, policy.min_prefill_speedup)]
    if policy.max_tpot_p99_s is not None:
        name, rule, missing = "serve/max_tpot_p99_s", f"{M.SERVE_TPOT_P99_S} <= max", []
        value = _need(variant, M.SERVE_TPOT_P99_S, "variant", missing)
        results.append(_missing(name, stage, rule, policy.max_tpot_p99_s, missing) if missing
                       else _at_most(name, stage, rule, value, policy.max_tpot_p99_s))
    return results


