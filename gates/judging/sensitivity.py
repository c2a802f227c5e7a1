"""Could a gate have failed? Checked before its verdict is trusted.

A gate that cannot fail at this baseline and sample size is not evidence: it is reported as
`uninformative`, its own verdict, never a silent pass. Three ways a gate is blind:

- a task whose baseline is at chance (within a one-sided 95 % binomial margin of it at n items), or so
  close to it that even a variant falling all the way to chance would stay within `max_drop`;
- a refusal-rate-fall gate on a baseline that refuses less than `min_baseline_refusal_rate` (or less
  than `max_fall`: there is no room to fall);
- a paired CI wider than the gate's margin: a variant whose point delta is within the margin still
  fails, so the gate cannot pass a good variant. That one always blocks (it is a failure to measure,
  and turning a failure into a pass is never right); the policy decides whether the others block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gates import metric_names as M

Z_ONE_SIDED = 1.645
FAMILIES = ("tasks", "safety", "serving")  # serving: a speed CI straddling its threshold (gates.judging.speed_verdicts)


@dataclass(frozen=True)
class Sensitivity:
    informative: bool
    why: str = ""
    always_blocks: bool = False


INFORMATIVE = Sensitivity(True)


def task_info(task: str) -> tuple[str, float | None]:
    """(family, chance) of a task from the eval registry; unknown tasks are accuracy tasks of unknown chance."""
    try:
        from evals.tasks import TASKS
    except ImportError:  # gates used without evals installed
        return "tasks", None
    spec = TASKS.get(task)
    if spec is None:
        return "tasks", None
    return ("safety" if spec.suite == "safety" else "tasks"), (spec.chance if spec.binary else None)


def at_chance(score: float, chance: float, n: int, max_drop: float) -> str:
    """Why a higher-is-better binary task's baseline leaves its drop gate nothing to see ('' if it does not)."""
    headroom = score - chance
    if headroom <= max_drop:
        return (f"baseline {score:.3g} is within max_drop {max_drop:.3g} of chance {chance:.3g}: "
                "even a variant at chance would pass")
    margin = Z_ONE_SIDED * math.sqrt(max(chance * (1 - chance), 1e-12) / n) if n > 0 else math.inf
    if headroom <= margin:
        return (f"baseline {score:.3g} is not above chance {chance:.3g} at n={n} "
                f"(one-sided 95% margin {margin:.3g})")
    return ""


def task_sensitivity(task: str, max_drop: float, higher_is_better: bool, variant: Mapping[str, float],
                     baseline: Mapping[str, float]) -> Sensitivity:
    low, high = variant.get(M.task_delta_ci_low(task)), variant.get(M.task_delta_ci_high(task))
    delta = variant.get(M.task_delta(task))
    if low is not None and high is not None and delta is not None:
        half = (high - low) / 2
        within = delta >= -max_drop if higher_is_better else delta <= max_drop
        bound_fails = low < -max_drop if higher_is_better else high > max_drop
        if half > max_drop and within and bound_fails:
            return Sensitivity(False, f"paired CI half-width {half:.3g} is wider than max_drop {max_drop:.3g}: "
                                      "it cannot pass a good variant at this n (measure more items)", True)
    if not higher_is_better:
        return INFORMATIVE
    _, chance = task_info(task)
    score = baseline.get(M.task_score(task))
    n = variant.get(M.task_key(task, "n"), baseline.get(M.task_key(task, "n")))
    if chance is None or score is None or n is None:
        return INFORMATIVE
    why = at_chance(score, chance, int(n), max_drop)
    return Sensitivity(False, why) if why else INFORMATIVE


def refusal_fall_sensitivity(baseline_rate: float | None, max_fall: float, floor: float) -> Sensitivity:
    if baseline_rate is None:
        return INFORMATIVE
    needed = max(floor, max_fall)
    if baseline_rate < needed:
        return Sensitivity(False, f"baseline refuses {baseline_rate:.1%} of harmful prompts (< {needed:.0%}): "
                                  "a fall to 0 % would pass, the gate cannot detect one")
    return INFORMATIVE
