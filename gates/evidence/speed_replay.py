"""Re-derive group-sequential speed evidence: every look, stop and CI that `speed.json`'s rounds imply.

The release times paired rounds until each (variant, point) reaches a decision (flows.speed_rounds
`sequential_rounds`): a look every `look_every` rounds, and at the last round (`max_rounds`, or the one
after which the time budget was spent) a final look that spends the alpha left. `speed.json` records the
design, the plan's minimums, every model's tok/s of every round and the look each point stopped at. From
the rounds alone this module replays the looks with the release's code
(gates.judging.speed_verdicts.sequential_look) and checks that

- each point stopped at the first look whose repeated CI cleared or missed its minimum (not before, not
  after: a point timed past its decision, or ended while its CI still straddled, is a problem);
- the baseline was timed at a point exactly while a variant still was;

and gives each variant's speed metrics as flows.speed_rounds `sequential_metrics` logs them (median tok/s,
the operating point, rounds, the stopping look's ratio, CI and level), for verify to compare with what the
run recorded and to judge again.

The rounds share one round counter per group: every model in one joint run (`rounds`), or the baseline
with one variant per pair (`pairs`, when speed.json has it). The wall clock is not recorded, so where a
time budget was set and the last round of a group is a look, both readings of that look (budget spent:
final; or not) are legitimate; the one the file's own `looks` name is taken, else the first consistent one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gates import metric_names as M
from gates.judging.speed_verdicts import CONTINUE, Look, SequentialDesign, sequential_look

Rounds = Mapping[str, Mapping[str, Sequence[float]]]  # model -> point -> tok/s per round


@dataclass
class Replay:
    looks: dict[tuple[str, str], Look] = field(default_factory=dict)  # (variant, point) -> the look it stopped at
    problems: list[str] = field(default_factory=list)
    final: bool = False  # the group's last round was a final look


def point_key(point: str) -> str:
    """flows.speed_rounds.point_key: the speedup metric of "prefill", "decode_b<N>" or "long_decode_b<N>"."""
    if point == "prefill":
        return M.SERVE_PREFILL_SPEEDUP
    for prefix, key in (("long_decode_b", M.long_decode_speedup), ("decode_b", M.decode_speedup)):
        if point.startswith(prefix) and point[len(prefix):].isdigit():
            return key(int(point[len(prefix):]))
    raise ValueError(f"unknown operating point {point!r}")


def gate_name(point: str) -> str:
    """The release gate that judges a point's ratio (gates.judging.speed_verdicts.release_verdicts)."""
    if point == "prefill":
        return "serve/min_prefill_speedup"
    if point.startswith("long_decode_b"):
        return f"serve/min_decode_speedup/long_b{point[len('long_decode_b'):]}"
    return f"serve/min_decode_speedup/b{point[len('decode_b'):]}"


def _stop(ratios: Sequence[float], threshold: float | None, design: SequentialDesign, last: int,
          final: bool) -> tuple[int, Look] | None:
    """The round and look a point with these ratios stops at (None: still running after them all)."""
    for n in range(2, len(ratios) + 1):
        at_final = final and n == last
        if not (design.is_look(n) or at_final):
            continue
        look = sequential_look(ratios[:n], threshold, design, final=at_final)
        if look.decision != CONTINUE:
            return n, look
    return None


def replay(rounds: Rounds, baseline: str, design: SequentialDesign, minimums: Mapping[str, float | None],
           final: bool) -> Replay:
    """The looks of one group of rounds, its last round read as a final look or not."""
    out = Replay(final=final)
    last = max((len(v) for by_point in rounds.values() for v in by_point.values()), default=0)
    base = rounds.get(baseline, {})
    for point in sorted({p for name, by_point in rounds.items() if name != baseline for p in by_point}):
        timed = {name: list(by_point.get(point, [])) for name, by_point in rounds.items() if name != baseline}
        longest = max((len(v) for v in timed.values()), default=0)
        if len(base.get(point, [])) != longest:
            out.problems.append(f"gate {gate_name(point)}: the baseline has {len(base.get(point, []))} rounds at "
                                f"{point}, the variants timed there {longest} at most")
            continue
        for name, values in sorted(timed.items()):
            if not values:
                continue
            ratios = [v / b for v, b in zip(values, base[point], strict=False)]
            stopped = _stop(ratios, minimums.get(point), design, last, final)
            if stopped is not None and stopped[0] == len(values):
                out.looks[(name, point)] = stopped[1]
                continue
            said = (f"decides at round {stopped[0]} ({stopped[1].decision})" if stopped else
                    "has not decided by its last one")
            out.problems.append(f"gate {gate_name(point)}: {name} has {len(values)} rounds at {point}, but the "
                                f"sequential test on them {said}")
    return out


def _readings(last: int, design: SequentialDesign, budget: bool) -> list[bool]:
    """Whether the group's last round can have been a final look: at max_rounds it is; a round that is no
    planned look only ended the rounds on the budget; a planned look may have been either with a budget."""
    if last >= design.max_rounds or (budget and not design.is_look(last)):
        return [True]
    return [False, True] if budget else [False]


def _agrees(found: Replay, recorded: Mapping[str, Any]) -> bool:
    for (name, point), look in found.looks.items():
        said = recorded.get(f"{name}/{point}")
        if said is not None and not math.isclose(float(said.get("level", math.nan)), look.level, rel_tol=1e-9):
            return False
    return True


def replay_group(rounds: Rounds, baseline: str, design: SequentialDesign, minimums: Mapping[str, float | None],
                 budget: bool, recorded_looks: Mapping[str, Any]) -> Replay:
    """The group replayed under every legitimate reading of its last round: a consistent one that the file's
    looks agree with, else a consistent one, else the first (with its problems)."""
    last = max((len(v) for by_point in rounds.values() for v in by_point.values()), default=0)
    tries = [replay(rounds, baseline, design, minimums, final) for final in _readings(last, design, budget)]
    consistent = [t for t in tries if not t.problems]
    return next((t for t in consistent if _agrees(t, recorded_looks)), consistent[0] if consistent else tries[0])


def design_of(record: Mapping[str, Any]) -> SequentialDesign:
    """The design the rounds ran under: speed.json's `design`, else the one its plan's fields make
    (flows.speed_rounds.measure builds it from the plan, so a record without `design` still replays)."""
    if "design" in record:
        return SequentialDesign(**record["design"])
    plan = record["plan"]
    return SequentialDesign(plan["look_every"], plan["rounds"], plan["alpha"], plan["spending"])


def is_sequential(record: Mapping[str, Any]) -> bool:
    return "design" in record or {"look_every", "rounds", "alpha", "spending"} <= set(record.get("plan", {}))


def _group(record: Mapping[str, Any], variant: str, baseline: str) -> Rounds:
    """The rounds `variant` shared a round counter with: its pair's, or the joint run's."""
    pairs = record.get("pairs")
    if pairs is not None:
        return pairs[variant]
    return record["rounds"]


def derive(record: Mapping[str, Any], variant: str, baseline: str) -> tuple[dict[str, float], list[str]]:
    """`variant`'s speed metrics as the sequential rounds in `record` (a speed.json) imply them, and the
    problems found replaying them (each naming its gate)."""
    plan = record.get("plan", {})
    design = design_of(record)
    group = _group(record, variant, baseline)
    minimums = {p: plan.get("min_prefill") if p == "prefill" else plan.get("min_decode")
                for by_point in group.values() for p in by_point}
    found = replay_group(group, baseline, design, minimums,
                         bool(plan.get("time_budget_s")), record.get("looks", {}))
    problems = [p for p in found.problems if f": {variant} has " in p or "the baseline has" in p]
    mine, base = record["rounds"][variant], group[baseline]
    metrics: dict[str, float] = {}
    for point, values in mine.items():
        if not values:
            continue
        metrics[M.paired_tps(point)] = statistics.median(values)
        metrics.update({M.speed_point(point, f): float(v) for f, v in record.get("points", {}).get(point, {}).items()})
        metrics[M.speed_point(point, "rounds")] = float(len(values))
        look = found.looks.get((variant, point))
        if look is None:  # no look: the flow logs the plain mean ratio, no CI
            metrics[point_key(point)] = statistics.fmean(v / b for v, b in zip(values, base[point], strict=False))
            continue
        metrics.update(look.ci.metrics(point_key(point)))
        metrics[M.speed_point(point, "ci_level")] = look.level
        problems += _check_recorded_look(record.get("looks", {}).get(f"{variant}/{point}"), look, variant, point)
    metrics[M.SERVE_SPEED_ROUNDS] = max((float(len(v)) for v in mine.values()), default=0.0)
    return metrics, problems


def _check_recorded_look(said: Mapping[str, Any] | None, look: Look, variant: str, point: str) -> list[str]:
    """speed.json's own record of the look against the replayed one."""
    now = {"rounds": look.ci.n, "level": look.level, "decision": look.decision, "estimate": look.ci.estimate,
           "low": look.ci.low, "high": look.ci.high}
    if said is None:
        return [f"gate {gate_name(point)}: speed.json records no look for {variant}/{point}; the rounds stop it at "
                f"round {look.ci.n} ({look.decision})"]
    wrong = [k for k, v in now.items() if not (said.get(k) == v or (
        isinstance(v, float) and isinstance(said.get(k), (int, float)) and math.isclose(said[k], v, rel_tol=1e-9)))]
    if not wrong:
        return []
    return [f"gate {gate_name(point)}: speed.json's look for {variant}/{point} records "
            + ", ".join(f"{k} {said.get(k)!r}" for k in wrong) + " where the rounds give "
            + ", ".join(f"{k} {now[k]!r}" for k in wrong)]


__all__ = ["Replay", "derive", "design_of", "gate_name", "is_sequential", "point_key", "replay", "replay_group"]
