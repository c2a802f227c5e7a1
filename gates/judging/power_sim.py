"""Simulated releases for checking gates.judging.power: crafted binary tasks drawn under its flip model, each draw
judged through the real CI (evals.compare.paired_delta_ci, all draws on one set of resamples as one
comparison is) and the real gate (gates.judging.judge.judge).
(The speed gates' power is simulated in gates.judging.power itself: judge imports it.)"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from evals.compare import paired_delta_ci
from gates import metric_names as M
from gates.judging import power as P
from gates.judging.judge import judge


@dataclass(frozen=True)
class SimulatedTask:
    """A crafted binary task for `simulate_task_gates`: baseline accuracy, flip rate, the variant's drop."""

    n: int
    score: float
    flip_rate: float = P.DEFAULT_FLIP_RATE
    drop: float = 0.0


def simulate_task_gates(policy, tasks: Mapping[str, SimulatedTask], draws: int = 200,
                        seed: int = 0) -> dict[str, np.ndarray]:
    """Per task, whether each of `draws` simulated variants passes its gate: items drawn under the flip
    model, the CI from evals.compare.paired_delta_ci and the verdict from gates.judging.judge.judge."""
    rng = np.random.default_rng(seed)
    variants: list[dict[str, float]] = [{} for _ in range(draws)]
    baselines: list[dict[str, float]] = [{} for _ in range(draws)]
    for i, (task, t) in enumerate(tasks.items()):
        lost, gained = t.flip_rate / 2 + t.drop, t.flip_rate / 2
        if not policy.task_gate(task).higher_is_better:
            raise ValueError(f"{task}: the simulation draws higher-is-better accuracy tasks only")
        if not (0 < t.score < 1 and lost <= t.score and gained <= 1 - t.score):
            raise ValueError(f"{task}: flip rate {t.flip_rate} and drop {t.drop} do not fit baseline score {t.score}")
        base = (rng.random((draws, t.n)) < t.score).astype(float)
        u = rng.random((draws, t.n))
        var = np.where(base == 1.0, u >= lost / t.score, u < gained / (1 - t.score)).astype(float)
        low, high, _ = paired_delta_ci(base, var, np.ones(t.n), "acc", seed + i)
        for d in range(draws):
            b, v = float(base[d].mean()), float(var[d].mean())
            variants[d].update(M.task_metrics(task, v, delta=v - b, ci_low=float(low[d]), ci_high=float(high[d]),
                                              n=t.n))
            baselines[d].update(M.task_metrics(task, b, n=t.n))
    passed = {task: np.zeros(draws, dtype=bool) for task in tasks}
    for d in range(draws):
        for r in judge(policy, variants[d], baselines[d]):
            task = r.name[len("task/"):-len("/max_drop")] if r.name.startswith("task/") else None
            if task in passed:
                passed[task][d] = r.passed
    return passed
