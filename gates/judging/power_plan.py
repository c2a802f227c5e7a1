"""`quantgate release --plan`'s sample sizes: the n per task that makes the policy pass a harmless variant with
a stated probability (each gate sized to level ** (1/k), gates.judging.power_gates' closed form), and its table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gates.judging.power_gates import (
    _NORMAL,
    CI_ALPHA,
    DEFAULT_FLIP_RATE,
    GatePower,
    family_harmless_pass,
    gate_power,
    item_sd,
    pass_probability,
    z_two_sided,
)

DEFAULT_SECONDS_PER_ITEM = 0.15  # eval time per item and model when none is given (docs/gates.md)


@dataclass(frozen=True)
class PlanTask:
    task: str
    max_drop: float
    flip_rate: float | None = DEFAULT_FLIP_RATE  # None: continuous metric, give sd
    sd: float | None = None
    available: int | None = None  # items the task has (None: unbounded)
    seconds_per_item: float = DEFAULT_SECONDS_PER_ITEM


@dataclass(frozen=True)
class PlanRow:
    task: str
    n: int
    needed: int | None  # the n the per-gate level asks for (None: no n reaches it, max_drop 0)
    available: int | None
    power: GatePower
    seconds: float  # eval time of this task for one model


@dataclass(frozen=True)
class Plan:
    level: float
    per_gate_level: float
    rows: list[PlanRow]
    models: int  # the baseline and each variant evaluate every task

    @property
    def family_harmless_pass(self) -> float:
        return family_harmless_pass([r.power for r in self.rows])

    @property
    def reached(self) -> bool:
        return self.family_harmless_pass >= self.level - 1e-12

    @property
    def seconds_per_model(self) -> float:
        return sum(r.seconds for r in self.rows)


def needed_n(max_drop: float, level: float, flip_rate: float | None = None, sd: float | None = None,
             alpha: float = CI_ALPHA) -> int | None:
    """The smallest n at which a harmless variant passes the gate with probability `level` (closed form)."""
    spread = item_sd(flip_rate) if flip_rate is not None else sd
    if spread is None:
        raise ValueError("give a flip_rate (binary task) or a per-item sd (continuous metric)")
    if spread == 0.0:
        return 1
    if max_drop <= 0.0:
        return None
    n = max(math.ceil(((z_two_sided(alpha) + _NORMAL.inv_cdf(level)) * spread / max_drop) ** 2 - 1e-9), 1)
    if flip_rate is None:
        return n
    # binary: the lattice margin is within 1/(2n) of max_drop, so the first n that reaches the level is near
    return next((k for k in range(1, 2 * n + 10) if pass_probability(k, max_drop, 0.0, flip_rate, alpha=alpha) >= level),
                n)


def plan(tasks: Sequence[PlanTask], level: float, models: int = 3, min_n: int = 20) -> Plan:
    """n per task so that a harmless variant passes every gate with probability `level`: each of the k
    gates is sized to level ** (1 / k), never below `min_n` nor above the items the task has."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"the family harmless-pass level must be in (0, 1), got {level}")
    if not tasks:
        raise ValueError("nothing to plan: no task gates")
    per_gate = level ** (1 / len(tasks))
    rows = []
    for t in tasks:
        need = needed_n(t.max_drop, per_gate, t.flip_rate, t.sd)
        n = max(min_n, need if need is not None else min_n)
        if t.available is not None:
            n = min(n, t.available) if need is not None else t.available
        power = gate_power(t.task, n, t.max_drop, t.flip_rate, t.sd)
        rows.append(PlanRow(t.task, n, need, t.available, power, n * t.seconds_per_item))
    return Plan(level, per_gate, rows, models)


def plan_markdown(p: Plan) -> str:
    lines = [f"# Sample-size plan: a harmless variant passes every task gate with probability >= {p.level:g}", "",
             f"{len(p.rows)} task gates, each sized to harmless-pass >= {p.per_gate_level:.4f} (= {p.level:g} ** "
             f"(1/{len(p.rows)}); gates independent).", "",
             "| task | max_drop | flip rate / item sd | n | items | harmless-pass | 80 %-refusal drop | s per model |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in p.rows:
        spread = f"{r.power.flip_rate:.3g}" if r.power.flip_rate is not None else f"sd {r.power.sd:.3g}"
        items = "—" if r.available is None else str(r.available)
        lines.append(f"| {r.task} | {r.power.max_drop:g} | {spread} | {r.n} | {items} | {r.power.harmless_pass:.4f} | "
                     f"{r.power.refusal80_drop:.3f} | {r.seconds:.0f} |")
    lines += ["", f"- family harmless-pass at these n: **{p.family_harmless_pass:.3f}** "
                  f"({'reaches' if p.reached else 'does NOT reach'} {p.level:g})",
              f"- eval time: {p.seconds_per_model:.0f} s per model, {p.seconds_per_model * p.models:.0f} s for "
              f"{p.models} models (the baseline and each variant)"]
    short = [r.task for r in p.rows if r.needed is None or (r.available is not None and r.needed > r.available)]
    if short:
        lines.append(f"- too few items to reach the per-gate level: {', '.join(short)} (raise max_drop, or "
                     "accept a lower family level)")
    return "\n".join(lines) + "\n"
