"""Evaluate a policy against what MLflow recorded for a variant run and its release's baseline, and
record every gate's verdict back on the run.

The record of a stage is `gates/<stage>/gates.json` (every field of every gate; what `read_evaluation` reads),
shown as `gates.md` (Markdown) and `gates_table.json` (a table the MLflow UI renders and sorts), beside
`policy.yaml` and, for the release stage, `task_deltas.png` and `speed.png` (coloured by verdict). The run's
description (`mlflow.note.content`, gates.records.run_notes) says the verdict and the gates behind it.
Metrics per gate (name like `task/arc_easy/max_drop`): `gate/<name>/pass` (1/0), `.../uninformative` (1/0),
`.../observed` (when measured), task gates' power figures (`.../harmless_pass`, `.../refusal80_drop`,
`.../underpowered`, gates.judging.power). Tags per gate, only for the gates a person must look at (failed,
uninformative, underpowered): `gate/<name>/verdict`, `.../blocks`, `.../observed` (and `.../underpowered`).
Per stage: tags `gates/<stage>/verdict` (written last), `.../evaluated_at`, `.../policy_sha256`,
`.../policy_source`, `.../baseline_run_id`, `.../failed`, `.../uninformative`, `.../underpowered`; metrics
`gates/<stage>/pass`, `.../family_harmless_pass`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import asdict, fields, replace
from typing import TYPE_CHECKING

from gates import metric_names as M
from gates.judging import power as P
from gates.judging.gate_report import render_markdown
from gates.judging.policy import Policy, load_policy
from gates.judging.verdicts import NOT_MEASURED, UNINFORMATIVE, Evaluation, GateResult
from gates.records import run_notes as notes
from gates.records.tracking import BASELINE, TAG_KIND, TAG_ROLE, baseline_run, get_client, get_run, log_batch

if TYPE_CHECKING:
    from mlflow import MlflowClient

from gates.judging.judge import judge


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
    stale = _recorded_gate_names(client, run, stage)
    # Nothing half-written looks complete: the stage verdict is "pending" until everything is recorded.
    client.set_tag(run_id, M.stage_tag(stage, "verdict"), "pending")
    for name in stale:
        for f in TAG_FIELDS:
            if M.gate_key(name, f) in run.data.tags:
                client.delete_tag(run_id, M.gate_key(name, f))
    metrics, tags = _gate_records(evaluation)
    log_batch(client, run_id, metrics=metrics, tags=tags)
    folder = f"gates/{stage}"
    client.log_text(run_id, render_markdown(evaluation, run.info.run_name or run_id), f"{folder}/gates.md")
    client.log_dict(run_id, _as_json(evaluation), f"{folder}/gates.json")
    client.log_text(run_id, policy.text, f"{folder}/policy.yaml")
    notes.log_gate_table(client, run_id, evaluation, run.data.metrics)
    if stage == "release":
        _log_plots(client, run, evaluation, policy)
    verdict = "pass" if evaluation.passed else "fail"
    version_tag = "verdict" if stage == "release" else f"{stage}_verdict"
    for mv in client.search_model_versions(f"run_id = '{run_id}'"):
        client.set_model_version_tag(mv.name, mv.version, version_tag, verdict)
    dtypes = notes.dtype_line(client, run_id, evaluation.extra.get("machine", ""))
    notes.set_note(client, run_id, notes.variant_note(evaluation, run.info.run_name or run_id, run.data.metrics,
                                                      dtypes=dtypes))
    client.set_tag(run_id, M.stage_tag(stage, "verdict"), verdict)


# Every per-gate tag field this module ever wrote (older runs carry all of them): cleared on re-evaluation.
TAG_FIELDS = ("verdict", "blocks", "reason", "rule", "threshold", "observed", "stage", *P.POWER_FIELDS)


def _recorded_gate_names(client: MlflowClient, run, stage: str) -> set[str]:
    """The gates an earlier evaluation of this stage recorded (its gates.json, or older runs' `/stage` tags)."""
    names = {key[len("gate/") : -len("/stage")] for key, value in run.data.tags.items()
             if key.startswith("gate/") and key.endswith("/stage") and value == stage}
    previous = _read_json(client, run.info.run_id, stage)
    return names | {r["name"] for r in (previous or {}).get("results", [])}


def _gate_records(evaluation: Evaluation) -> tuple[dict[str, float], dict[str, str]]:
    """Per gate: pass/uninformative/observed (and power) metrics; tags only for the gates a person must look
    at (failed, uninformative, underpowered), so one can filter runs on them. Every field of every gate is in
    `gates.json` and the `gates_table.json` table; a tag per field made the run page a wall of chips."""
    stage = evaluation.stage
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    for r in evaluation.results:
        metrics[M.gate_key(r.name, "pass")] = 1.0 if r.passed else 0.0
        metrics[M.gate_key(r.name, UNINFORMATIVE)] = 1.0 if r.verdict == UNINFORMATIVE else 0.0
        if r.observed is not None:
            metrics[M.gate_key(r.name, "observed")] = r.observed
        power = P.power_tags(r)
        metrics.update({M.gate_key(r.name, f): float(getattr(r, f)) for f in P.POWER_FIELDS if power})
        if notes.is_clean_pass(r):
            continue
        tags[M.gate_key(r.name, "verdict")] = r.verdict
        tags[M.gate_key(r.name, "blocks")] = "false" if r.passed else "true"
        tags[M.gate_key(r.name, "observed")] = NOT_MEASURED if r.observed is None else repr(r.observed)
        if power:
            tags[M.gate_key(r.name, "underpowered")] = power["underpowered"]
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
    return metrics, tags


def _log_plots(client: MlflowClient, run, evaluation: Evaluation, policy: Policy) -> None:
    from gates.records.release_plots import speed_figure, task_delta_figure

    name = run.info.run_name or run.info.run_id
    verdicts = {r.name: r for r in evaluation.results}
    figure = task_delta_figure(run.data.metrics, policy, title=f"{name}: task deltas vs baseline", verdicts=verdicts)
    if figure is not None:
        client.log_figure(run.info.run_id, figure, f"gates/{evaluation.stage}/task_deltas.png")
    figure = speed_figure(run.data.metrics, evaluation.results, title=f"{name}: paired speed ratios vs baseline")
    if figure is not None:
        client.log_figure(run.info.run_id, figure, f"gates/{evaluation.stage}/speed.png")


def _as_json(evaluation: Evaluation) -> dict:
    data = asdict(evaluation)
    data["passed"] = evaluation.passed
    return data


def read_evaluation(run_id: str, stage: str = "release", client: MlflowClient | None = None) -> Evaluation | None:
    """The verdicts recorded on a run (None when never evaluated): its `gates.json`, or, on runs recorded
    before that file was the record, its per-gate tags."""
    client = client or get_client()
    tags = get_run(run_id, client).data.tags
    if M.stage_tag(stage, "verdict") not in tags:
        return None
    extra = {"verdict": tags[M.stage_tag(stage, "verdict")], "machine": tags.get(M.MACHINE_TAG, "")}
    data = _read_json(client, run_id, stage)
    if data is not None:
        results = [_with_tags(GateResult(**{k: v for k, v in r.items() if k in _RESULT_FIELDS}), tags)
                   for r in data["results"]]
        return Evaluation(run_id=run_id, stage=stage, results=results, evaluated_at=data.get("evaluated_at", ""),
                          policy_sha256=data.get("policy_sha256", ""), policy_source=data.get("policy_source", ""),
                          baseline_run_id=data.get("baseline_run_id", ""), extra=extra)
    return _read_from_tags(run_id, stage, tags, extra)


_RESULT_FIELDS = {f.name for f in fields(GateResult)}


def _with_tags(result: GateResult, tags: Mapping[str, str]) -> GateResult:
    """A gate as gates.json recorded it, with whatever its filterable tags say on top: a tag changed after the
    evaluation changes what is read, so `quantgate verify` sees it disagree with the manifest."""
    key = lambda f: M.gate_key(result.name, f)  # noqa: E731
    if not any(key(f) in tags for f in ("verdict", "blocks", "observed", "underpowered")):
        return result
    verdict = tags.get(key("verdict"), result.verdict)
    blocks = tags.get(key("blocks"), "false" if result.passed else "true")
    observed = tags.get(key("observed"))
    return replace(result, verdict=verdict,
                   passed=verdict == "pass" or (verdict == UNINFORMATIVE and blocks == "false"),
                   observed=result.observed if observed is None else None if observed == NOT_MEASURED else float(observed),
                   underpowered=tags.get(key("underpowered"), str(result.underpowered).lower()) == "true")


def _read_json(client: MlflowClient, run_id: str, stage: str) -> dict | None:
    """`gates/<stage>/gates.json` of a run; None when it was never written (or cannot be read)."""
    import json
    import tempfile

    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="quantgate-gates-") as tmp:
        try:
            path = client.download_artifacts(run_id, f"gates/{stage}/gates.json", tmp)
        except (MlflowException, OSError):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def _read_from_tags(run_id: str, stage: str, tags: Mapping[str, str], extra: dict) -> Evaluation:
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
        extra=extra,
    )
