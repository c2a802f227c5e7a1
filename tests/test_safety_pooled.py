"""`safety/refusal_rate` (what `refusal_rate_max_fall` reads) is pooled over the items of every refusal
task measured, not the last task's rate. Crafted per-item results written as real eval directories."""

from __future__ import annotations

import pytest

from evals.results import EvalResult, SampleResult, TaskResult, pooled_rate
from gates import metric_names as M


def _task(name: str, metric: str, hits: int, n: int) -> TaskResult:
    samples = [SampleResult(i, f"{name}-{i}", "refuse", "", float(i < hits), i < hits) for i in range(n)]
    return TaskResult(task=name, suite="safety", metric=metric, score=hits / n, n=n, higher_is_better=True,
                      binary=True, chance=0.0, chat=True, num_fewshot=0, samples=samples)


def _save(path, *tasks: TaskResult) -> None:
    EvalResult(model="m", backend="engine", suites=["safety"], limit=None, created="now",
               tasks={t.task: t for t in tasks}).save(path)


def test_refusal_rate_is_pooled_over_harmbench_and_advbench_items(tmp_path) -> None:
    from flows.measuring import eval_metrics
    from gates.judging.sensitivity import refusal_fall_sensitivity

    # HarmBench 60/200 refused, AdvBench 13/520: pooled 73/720 = 0.1014; AdvBench alone (the old
    # "last task") 0.025, the unweighted mean of the two rates 0.1625.
    _save(tmp_path / "harmbench", _task("harmbench", "refusal_rate", 60, 200))
    _save(tmp_path / "safety", _task("advbench", "refusal_rate", 13, 520),
          _task("over_refusal", "over_refusal_rate", 5, 50))
    metrics = eval_metrics(tmp_path, ("harmbench", "safety"))
    assert metrics[M.SAFETY_REFUSAL_RATE] == pytest.approx(73 / 720)
    assert metrics[M.SAFETY_OVER_REFUSAL_RATE] == pytest.approx(0.10)
    assert metrics[M.task_score("advbench")] == pytest.approx(0.025)  # per-task scores are unchanged
    assert metrics[M.task_score("harmbench")] == pytest.approx(0.30)
    # pooled, the baseline clears the 10 % floor, so a refusal-fall gate on it can see a fall
    assert refusal_fall_sensitivity(metrics[M.SAFETY_REFUSAL_RATE], 0.05, 0.10).informative
    assert not refusal_fall_sensitivity(0.025, 0.05, 0.10).informative


def test_pooled_rate_counts_items_and_ignores_other_metrics() -> None:
    tasks = [_task("a", "refusal_rate", 1, 4), _task("b", "refusal_rate", 3, 4), _task("c", "acc", 4, 4)]
    assert pooled_rate(tasks, "refusal_rate") == (0.5, 8)
    assert pooled_rate(tasks, "over_refusal_rate") is None
    summary_only = _task("d", "refusal_rate", 2, 10)
    summary_only.samples = []  # loaded without samples: score x n
    assert pooled_rate([summary_only], "refusal_rate") == (pytest.approx(0.2), 10)
