"""Simulated releases for checking gates.judging.power: crafted binary tasks drawn under its flip model, each draw
judged through the real CI (evals.compare.paired_delta_ci, all draws on one set of resamples as one
comparison is) and the real gate (gates.judging.judge.judge).

The speed gates' power is simulated too (`speed_pass_probability`): the sequential test has no closed form,
so seeded draws of per-round log ratios at the measured ratio and noise go through the real looks
(gates.judging.speed_verdicts.sequential_look). judge imports this module, so judge is imported late here."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gates import metric_names as M
from gates.judging import power as P
from gates.judging import speed_verdicts as V

SPEED_DRAWS = 300  # simulated point runs per speed gate: the figure's sd is <= 0.03
SPEED_SEED = 0


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
    from evals.compare import paired_delta_ci
    from gates.judging.judge import judge  # judge imports this module for the speed gates' power
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


def round_sd(low: float, high: float, rounds: int, level: float) -> float:
    """The per-round sd of the log ratio that a t interval at `level` over `rounds` rounds was built from (the
    interval is mean +- t * sd / sqrt(rounds), so this reads back exactly the rounds' own sd)."""
    if rounds < 2 or not 0 < low <= high:
        raise ValueError(f"a CI over >= 2 rounds with 0 < low <= high is needed, got {rounds}, {low}, {high}")
    return (math.log(high) - math.log(low)) / 2 / V.t_two_sided(level, rounds - 1) * math.sqrt(rounds)


@functools.lru_cache(maxsize=1024)  # judge, the report and verify ask again for the same recorded point
def speed_pass_probability(ratio: float, sd: float, threshold: float, design: V.SequentialDesign,
                           max_rounds: int | None = None, draws: int = SPEED_DRAWS, seed: int = SPEED_SEED) -> float:
    """Share of `draws` simulated point runs (log ratios ~ N(log ratio, sd) per round) that the sequential test
    passes, looks as `design` places them, stopped at `max_rounds` (a time budget's cap; default the design's)."""
    cap = min(max_rounds or design.max_rounds, design.max_rounds)
    if cap < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    logs = rng.normal(math.log(ratio), max(sd, 1e-12), size=(draws, cap))
    passed = 0
    for row in np.exp(logs):
        for k in range(2, cap + 1):
            final = k >= cap
            if not (design.is_look(k) or final):
                continue
            look = V.sequential_look(list(row[:k]), threshold, design, final=final)
            if look.decision != V.CONTINUE:
                passed += look.decision == V.PASS
                break
    return passed / draws


def design_of(policy) -> V.SequentialDesign:
    s = policy.speed
    return V.SequentialDesign(s.look_every, s.max_rounds, s.alpha, s.spending)


_GATE_POINT = ((re.compile(r"^decode_speedup_b(\d+)$"), "serve/min_decode_speedup/b{}", "decode_b{}"),
               (re.compile(r"^long_decode_speedup_b(\d+)$"), "serve/min_decode_speedup/long_b{}", "long_decode_b{}"),
               (re.compile(r"^(prefill)_speedup$"), "serve/min_prefill_speedup", "prefill"))


def speed_powers(policy, variant, max_rounds: int | None = None) -> dict[str, P.GatePower]:
    """Per speed gate with a recorded CI: its pass probability at the measured ratio and per-round noise
    (`refusal80_drop` is NaN: no closed form, and a search over simulations costs more than the figure is worth)."""
    out: dict[str, P.GatePower] = {}
    design = design_of(policy)
    for key in sorted(k for k in variant if k.startswith("serve/")):
        for pattern, gate, point in _GATE_POINT:
            m = pattern.match(key[len("serve/"):])
            threshold = policy.min_prefill_speedup if point == "prefill" else policy.min_decode_speedup
            if not m or threshold is None:
                continue
            arg = m.group(1)
            gate_name, point_name = gate.format(arg), point.format(arg)
            low, high = variant.get(M.ci(key, "ci_low")), variant.get(M.ci(key, "ci_high"))
            n = variant.get(M.speed_point(point_name, "rounds"), variant.get(M.SERVE_SPEED_ROUNDS))
            if low is None or high is None or not n or n < 2 or low <= 0:
                continue
            level = variant.get(M.speed_point(point_name, "ci_level"), V.CONFIDENCE)
            sd = round_sd(low, high, int(n), level)
            p = speed_pass_probability(variant[key], sd, threshold, design, max_rounds)
            out[gate_name] = P.GatePower(gate_name, int(n), threshold, sd, None, p, float("nan"),
                                         policy.min_harmless_pass is not None and p < policy.min_harmless_pass)
    return out
