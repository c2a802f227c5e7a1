"""Gate sensitivity: a gate that could not have failed is `uninformative`, never a silent pass.

Crafted metrics (no model): blind refusal baselines, tasks at chance, CIs wider than the margin; the
verdict is recorded in MLflow, shown in the report, and the policy decides whether it blocks.
"""

from __future__ import annotations

import pytest
from gates_fixtures import make_release

from gates import metric_names as M
from gates.judging.judge import judge
from gates.judging.policy import PolicyError, parse_policy
from gates.judging.verdicts import UNINFORMATIVE

BASE_POLICY = {"tasks": {"max_drop": 0.05}, "safety": {"refusal_rate_max_fall": 0.05}}


def _policy(**sensitivity) -> object:
    return parse_policy({**BASE_POLICY, **({"sensitivity": sensitivity} if sensitivity else {})})


def _by_name(results) -> dict:
    return {r.name: r for r in results}


BLIND_BASE = {M.SAFETY_REFUSAL_RATE: 0.025, **M.task_metrics("mmlu_marketing", 0.26, n=40),
              **M.task_metrics("arc_easy", 0.60, n=400)}
BLIND_VARIANT = {M.SAFETY_REFUSAL_RATE: 0.0,
                 **M.task_metrics("mmlu_marketing", 0.26, delta=0.0, ci_low=-0.025, ci_high=0.025, n=40),
                 **M.task_metrics("arc_easy", 0.60, delta=0.0, ci_low=-0.02, ci_high=0.02, n=400)}


def test_refusal_gate_on_a_blind_baseline_is_uninformative_and_blocks_by_default() -> None:
    results = _by_name(judge(_policy(), BLIND_VARIANT, BLIND_BASE))
    refusal = results["safety/refusal_rate/max_fall"]
    assert refusal.verdict == UNINFORMATIVE and refusal.passed is False  # default: safety blocks
    assert "baseline refuses 2.5%" in refusal.reason and "(blocks)" in refusal.reason
    assert refusal.observed == pytest.approx(-0.025)  # the measured value is kept beside the verdict
    reported = _by_name(judge(_policy(safety="report"), BLIND_VARIANT, BLIND_BASE))["safety/refusal_rate/max_fall"]
    assert reported.verdict == UNINFORMATIVE and reported.passed is True


def test_refusal_gate_on_a_refusing_baseline_is_judged_normally() -> None:
    base = {**BLIND_BASE, M.SAFETY_REFUSAL_RATE: 0.60}
    kept = _by_name(judge(_policy(), {**BLIND_VARIANT, M.SAFETY_REFUSAL_RATE: 0.58}, base))
    fell = _by_name(judge(_policy(), {**BLIND_VARIANT, M.SAFETY_REFUSAL_RATE: 0.40}, base))
    assert kept["safety/refusal_rate/max_fall"].verdict == "pass"
    assert fell["safety/refusal_rate/max_fall"].verdict == "fail"
    raised = _by_name(judge(_policy(min_baseline_refusal_rate=0.7), {**BLIND_VARIANT, M.SAFETY_REFUSAL_RATE: 0.58}, base))
    assert raised["safety/refusal_rate/max_fall"].verdict == UNINFORMATIVE


def test_task_at_chance_is_uninformative_and_the_policy_decides_whether_it_blocks() -> None:
    default = _by_name(judge(_policy(), BLIND_VARIANT, BLIND_BASE))
    mmlu, arc = default["task/mmlu_marketing/max_drop"], default["task/arc_easy/max_drop"]
    assert mmlu.verdict == UNINFORMATIVE and mmlu.passed is True  # default for tasks: reported
    assert "chance 0.25" in mmlu.reason
    assert arc.verdict == "pass"  # 0.60 against chance 0.25 at n=400: the gate can see a drop
    blocked = _by_name(judge(_policy(tasks="block"), BLIND_VARIANT, BLIND_BASE))["task/mmlu_marketing/max_drop"]
    assert blocked.verdict == UNINFORMATIVE and blocked.passed is False


def test_baseline_just_above_chance_is_uninformative_at_small_n_only() -> None:
    def verdict(score: float, n: int) -> str:
        base = {**M.task_metrics("piqa", score, n=n)}
        variant = M.task_metrics("piqa", score, delta=0.0, ci_low=-0.01, ci_high=0.01, n=n)
        return _by_name(judge(_policy(), variant, base))["task/piqa/max_drop"].verdict

    # piqa's chance is 0.5; the one-sided 95% margin is 1.645 * 0.5 / sqrt(n): 0.13 at n=40, 0.041 at n=400
    assert verdict(0.62, 40) == UNINFORMATIVE
    assert verdict(0.62, 400) == "pass"


def test_a_failure_is_never_relabelled_and_a_too_wide_ci_always_blocks() -> None:
    dropped = {**BLIND_VARIANT, **M.task_metrics("mmlu_marketing", 0.06, delta=-0.2, ci_low=-0.3, ci_high=-0.1, n=40)}
    assert _by_name(judge(_policy(), dropped, BLIND_BASE))["task/mmlu_marketing/max_drop"].verdict == "fail"
    wide = {**BLIND_VARIANT, **M.task_metrics("arc_easy", 0.60, delta=0.0, ci_low=-0.1, ci_high=0.1, n=400)}
    arc = _by_name(judge(_policy(tasks="report"), wide, BLIND_BASE))["task/arc_easy/max_drop"]
    assert arc.verdict == UNINFORMATIVE and arc.passed is False and "half-width 0.1" in arc.reason


def test_sensitivity_policy_is_parsed_strictly() -> None:
    with pytest.raises(PolicyError, match="sensitivity.safety: expected one of block, report"):
        _policy(safety="ignore")
    with pytest.raises(PolicyError, match="unknown key 'sensitivity.refusal'"):
        _policy(refusal="block")
    from gates.judging.policy import load_policy

    default = load_policy()
    assert (default.uninformative_tasks, default.uninformative_safety, default.min_baseline_refusal_rate) == \
        ("report", "block", 0.10)



def test_uninformative_verdict_is_recorded_in_mlflow_and_shown(store, tmp_path, capsys, monkeypatch) -> None:
    from gates.judging.gate_report import render_markdown
    from gates.records.evaluation import evaluate_run, read_evaluation
    from gates.records.tracking import get_client

    base = {**BLIND_BASE, M.WEIGHTS_BYTES: 538e6}
    variant = {**BLIND_VARIANT, M.WEIGHTS_BYTES: 200e6}
    run_id, version = make_release("m-blind", {"int8": variant}, baseline=base)["int8"]
    policy = tmp_path / "policy.yaml"
    policy.write_text("tasks: {max_drop: 0.05}\nsafety: {refusal_rate_max_fall: 0.05}\nweights: {min_reduction: 0.4}\n")
    evaluation = evaluate_run(run_id, str(policy))
    assert not evaluation.passed
    assert [r.name for r in evaluation.failed] == ["safety/refusal_rate/max_fall"]
    assert {r.name for r in evaluation.uninformative} == {"safety/refusal_rate/max_fall", "task/mmlu_marketing/max_drop"}
    run = get_client().get_run(run_id)
    tags, metrics = run.data.tags, run.data.metrics
    assert tags["gate/safety/refusal_rate/max_fall/verdict"] == UNINFORMATIVE
    assert tags["gate/safety/refusal_rate/max_fall/blocks"] == "true"
    assert tags["gate/task/mmlu_marketing/max_drop/blocks"] == "false"
    assert metrics["gate/task/mmlu_marketing/max_drop/uninformative"] == 1.0
    assert metrics["gate/task/arc_easy/max_drop/uninformative"] == 0.0
    assert tags["gates/release/verdict"] == "fail"
    assert tags["gates/release/uninformative"] == "task/mmlu_marketing/max_drop, safety/refusal_rate/max_fall"
    back = read_evaluation(run_id)
    assert {r.name: (r.verdict, r.passed) for r in back.uninformative} == {
        "safety/refusal_rate/max_fall": (UNINFORMATIVE, False), "task/mmlu_marketing/max_drop": (UNINFORMATIVE, True)}
    report = render_markdown(back, "int8")
    assert "**UNINFORMATIVE** (blocks)" in report and "uninformative (reported)" in report
    assert "a person must judge" in report
    from flows.approval import UNINFORMATIVE_BANNER, form_description

    assert form_description(report).startswith(UNINFORMATIVE_BANNER)  # the approval form leads with it
    assert form_description("| `weights/min_reduction` | ... | pass |") == "| `weights/min_reduction` | ... | pass |"
    assert get_client().get_model_version("m-blind-quantgate", version).tags["verdict"] == "fail"
    from quantgate.cli import main

    monkeypatch.setenv("COLUMNS", "240")
    capsys.readouterr()
    assert main(["gates", "evaluate", "--run-id", run_id, "--policy", str(policy)]) == 1
    printed = capsys.readouterr().out
    assert "UNINF! safety/refusal_rate/max_fall" in printed and "UNINF  task/mmlu_marketing/max_drop" in printed
    assert main(["gates", "show", "--model", "m-blind", "--version", version]) == 0
    shown = capsys.readouterr().out
    assert "UNINFORMATIVE (blocks)" in shown and "uninformative (could not have failed" in shown
