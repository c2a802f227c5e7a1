"""Evaluate a policy against what MLflow recorded for a variant run and its release's baseline, and
record every gate's verdict back on the run (metrics, tags, a `gates.md` report, a plot).

Recorded per gate (name like `task/arc_easy/max_drop`): metrics `gate/<name>/pass` (1/0),
`gate/<name>/threshold`, `gate/<name>/observed` (only when measured), `gate/<name>/uninformative` (1/0);
tags `gate/<name>/verdict` ("pass"/"fail"/"uninformative": `gates.sensitivity`, `gates.speed`), `.../blocks`
("true"/"false": whether it stops the variant), `.../reason`, `.../rule`, `.../threshold`,
`.../observed` ("not measured" when missing), `.../stage`; task gates also `.../harmless_pass`,
`.../refusal80_drop`, `.../underpowered` (metrics and tags, gates.power). Per stage: tags `gates/<stage>/verdict` (written last), `.../evaluated_at`,
`.../policy_sha256`, `.../policy_source`, `.../baseline_run_id`, `.../failed`, `.../uninformative`; metric
`gates/<stage>/pass`, `.../family_harmless_pass`; artifacts `gates/<stage>/gates.md`, `gates.json`, `policy.yaml`, `task_deltas.png`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from gates import fidelity_gates, speed
from gates import metrics as M
from gates import power as P
from gates import sensitivity as S
from gates.policy import Policy, load_policy
from gates.report import render_markdown
from gates.tracking import BASELINE, TAG_KIND, TAG_ROLE, _log_batch, baseline_run, get_client, get_run
from gates.verdicts import NOT_MEASURED, UNINFORMATIVE, Evaluation, GateResult

if TYPE_CHECKING:
    from mlflow import MlflowClient

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
    """Every gate of `stage` against the recorded metrics; a missing metric fails its gate. Task gates
    carry their power (gates.power) at the variant's measured `flip_rates`, else the default rate."""
    M.stage_tag(stage, "verdict")  # validates the stage name
    if stage == "canary":
        return _canary_gates(policy, variant)
    base = baseline or {}
    tasks = P.with_power(_task_gates(policy, variant, base, stage), P.task_powers(policy, variant, base, flip_rates))
    seen = [_speed_result(v, stage, policy, family) for v, family in fidelity_gates.verdicts(policy, variant)]
    return tasks + _baseline_gates(policy, variant, base, baseline is not None, stage) + seen


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


def evaluate_run(
    run_id: str,
    policy: Policy | str | None = None,
    stage: str = "release",
    client: MlflowClient | None = None,
) -> Evaluation:
    """Read the variant's and baseline's metrics back from MLflow, judge, and record the verdicts."""
    client = client or get_client()
    if not isinstance(policy, Policy):
        policy = load_policy(policy)
    run = get_run(run_id, client)
    if run.data.tags.get(TAG_KIND) != "variant":
        raise ValueError(f"run {run_id} is not a quantgate variant run; gates judge variant runs")
    if run.data.tags.get(TAG_ROLE) == BASELINE:
        raise ValueError(f"run {run_id} is the baseline; gates judge variants against it")
    base = baseline_run(run_id, client)
    rates = P.recorded_flip_rates(client, run_id) if stage == "release" else {}
    results = judge(policy, run.data.metrics, base.data.metrics if base else None, stage, rates)
    evaluation = Evaluation(
        run_id=run_id,
        stage=stage,
        results=results,
        evaluated_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        policy_sha256=policy.sha256,
        policy_source=policy.source,
        baseline_run_id=base.info.run_id if base else "",
        extra={"machine": run.data.tags.get(M.MACHINE_TAG, "")},
    )
    _record(client, run, evaluation, policy, base.data.metrics if base else {})
    return evaluation


def _record(client: MlflowClient, run, evaluation: Evaluation, policy: Policy, baseline: Mapping[str, float]) -> None:
    run_id, stage = evaluation.run_id, evaluation.stage
    # Nothing half-written looks complete: the stage verdict is "pending" until everything is recorded.
    client.set_tag(run_id, M.stage_tag(stage, "verdict"), "pending")
    for key, value in run.data.tags.items():
        if key.startswith("gate/") and key.endswith("/stage") and value == stage:
            name = key[len("gate/") : -len("/stage")]
            for f in ("verdict", "blocks", "reason", "rule", "threshold", "observed", "stage", *P.POWER_FIELDS):
                if M.gate_key(name, f) in run.data.tags:
                    client.delete_tag(run_id, M.gate_key(name, f))
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    for r in evaluation.results:
        metrics[M.gate_key(r.name, "pass")] = 1.0 if r.passed else 0.0
        metrics[M.gate_key(r.name, "threshold")] = r.threshold
        metrics[M.gate_key(r.name, UNINFORMATIVE)] = 1.0 if r.verdict == UNINFORMATIVE else 0.0
        if r.observed is not None:
            metrics[M.gate_key(r.name, "observed")] = r.observed
        power = P.power_tags(r)
        metrics.update({M.gate_key(r.name, f): float(getattr(r, f)) for f in P.POWER_FIELDS if power})
        tags.update({M.gate_key(r.name, f): value for f, value in power.items()})
        fields = {
            "verdict": r.verdict,
            "blocks": "false" if r.passed else "true",
            "reason": r.reason,
            "rule": r.rule,
            "threshold": repr(r.threshold),
            "observed": NOT_MEASURED if r.observed is None else repr(r.observed),
            "stage": stage,
        }
        tags.update({M.gate_key(r.name, f): value for f, value in fields.items()})
    metrics[M.stage_tag(stage, "pass")] = 1.0 if evaluation.passed else 0.0
    metrics.update(P.family_metric(evaluation.results, M.stage_tag(stage, "family_harmless_pass")))
    stage_fields = {
        "evaluated_at": evaluation.evaluated_at,
        "policy_sha256": evaluation.policy_sha256,
        "policy_source": evaluation.policy_source,
        "baseline_run_id": evaluation.baseline_run_id,
        "failed": ", ".join(r.name for r in evaluation.failed)[:7000],
        UNINFORMATIVE: ", ".join(r.name for r in evaluation.uninformative)[:7000],
        "underpowered": ", ".join(r.name for r in evaluation.results if r.underpowered)[:7000],
    }
    tags.update({M.stage_tag(stage, f): value for f, value in stage_fields.items()})
    _log_batch(client, run_id, metrics=metrics, tags=tags)
    folder = f"gates/{stage}"
    client.log_text(run_id, render_markdown(evaluation, run.info.run_name or run_id), f"{folder}/gates.md")
    client.log_dict(run_id, _as_json(evaluation), f"{folder}/gates.json")
    client.log_text(run_id, policy.text, f"{folder}/policy.yaml")
    if stage == "release":
        from gates.plots import task_delta_figure

        figure = task_delta_figure(run.data.metrics, policy, title=f"{run.info.run_name}: paired deltas vs baseline")
        if figure is not None:
            client.log_figure(run_id, figure, f"{folder}/task_deltas.png")
    verdict = "pass" if evaluation.passed else "fail"
    version_tag = "verdict" if stage == "release" else f"{stage}_verdict"
    for mv in client.search_model_versions(f"run_id = '{run_id}'"):
        client.set_model_version_tag(mv.name, mv.version, version_tag, verdict)
    client.set_tag(run_id, M.stage_tag(stage, "verdict"), verdict)


def _as_json(evaluation: Evaluation) -> dict:
    data = asdict(evaluation)
    data["passed"] = evaluation.passed
    return data


def read_evaluation(run_id: str, stage: str = "release", client: MlflowClient | None = None) -> Evaluation | None:
    """The verdicts recorded on a run (None when never evaluated), from tags alone."""
    client = client or get_client()
    tags = get_run(run_id, client).data.tags
    if M.stage_tag(stage, "verdict") not in tags:
        return None
    results = []
    for key, value in sorted(tags.items()):
        if not (key.startswith("gate/") and key.endswith("/stage") and value == stage):
            continue
        name = key[len("gate/") : -len("/stage")]
        observed = tags.get(M.gate_key(name, "observed"), NOT_MEASURED)
        verdict = tags.get(M.gate_key(name, "verdict"), "fail")
        blocks = tags.get(M.gate_key(name, "blocks"), "false" if verdict == "pass" else "true")
        results.append(
            GateResult(
                name=name,
                stage=stage,
                rule=tags.get(M.gate_key(name, "rule"), ""),
                threshold=float(tags.get(M.gate_key(name, "threshold"), "nan")),
                observed=None if observed == NOT_MEASURED else float(observed),
                passed=verdict == "pass" or (verdict == UNINFORMATIVE and blocks == "false"),
                reason=tags.get(M.gate_key(name, "reason"), ""),
                verdict=verdict,
                **P.power_from_tags(tags, lambda f, name=name: M.gate_key(name, f)),
            )
        )
    families = ("tasks", "task", "safety", "weights", "serve", "canary")
    results.sort(key=lambda r: (families.index(r.name.split("/")[0]) if r.name.split("/")[0] in families else 99, r.name))
    return Evaluation(
        run_id=run_id,
        stage=stage,
        results=results,
        evaluated_at=tags.get(M.stage_tag(stage, "evaluated_at"), ""),
        policy_sha256=tags.get(M.stage_tag(stage, "policy_sha256"), ""),
        policy_source=tags.get(M.stage_tag(stage, "policy_source"), ""),
        baseline_run_id=tags.get(M.stage_tag(stage, "baseline_run_id"), ""),
        extra={"verdict": tags[M.stage_tag(stage, "verdict")], "machine": tags.get(M.MACHINE_TAG, "")},
    )
