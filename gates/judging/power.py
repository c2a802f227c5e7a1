"""Power of the task gates: how likely a harmless variant passes each gate and the whole policy, which
drop a gate refuses, and the n per task that makes the policy pass a harmless variant with a stated
probability (`quantgate release --plan`).

A task gate is a non-inferiority test: it passes when the paired 95 % CI of variant - baseline has its
low end at or above -max_drop (evals.compare.paired_delta_ci, gates.records.evaluation). With the per-item
difference D in {-1, 0, +1}, its mean is close to normal with variance var(D) / n, and the CI's low end
is about mean - z * sd(D) / sqrt(n), so a variant whose true score is `drop` worse passes with

    P(pass) = Phi((max_drop - drop) * sqrt(n) / sd(D) - z),    z = Phi^-1(1 - alpha / 2),

with max_drop moved to the half step of the 1/n lattice a binary task's deltas live on (lattice_margin).

The flip model behind sd(D): a harmless variant changes the answer on a fraction `flip_rate` of the
items, half right->wrong and half wrong->right; a variant `drop` worse loses `drop` more items right->wrong,
so var(D) = flip_rate + drop - drop^2. A task scored by a continuous metric (bits per byte) has no flips:
its per-item sd comes from the measured CI instead. The flip rate is the variant's own (from its
comparison) when recorded, else DEFAULT_FLIP_RATE. Gates judge disjoint item sets, so the policy's
harmless-pass probability is the product over its task gates (an independence assumption, stated in
the report; gates.judging.power_sim checks it on crafted data through the real CI and the real gate).

Power never changes a verdict: a gate passed at low power still showed the drop is within max_drop
(the burden of proof stays on the variant); a gate below `min_harmless_pass` is labelled `underpowered`,
which says that a refusal there may come from too few items rather than from harm.

The other gate families (`family_powers`, attached by gates.judging.judge), each a pass probability:
- safety (refusal_rate max_fall, over_refusal_rate max_rise): the gate compares point rates, no CI, so a
  variant with the baseline's rate p whose refuse/comply answer flips on a fraction of the n pooled items
  (the refusal tasks' measured flip rate, else DEFAULT_FLIP_RATE, capped at 2 min(p, 1 - p)), half each
  way, passes with Phi(lattice_margin(n, max) * sqrt(n) / sd(D)) (the z is 0);
- long context, per length: the variant retrieves each of the length's n probes independently with the
  baseline's accuracy p (binomial per probe: a flip rate 2 p (1 - p)), judged as a task gate;
- fidelity: a variant identical to the baseline has KL 0 and passes surely, so the figure is at the
  measured effect instead: P(the CI high end stays <= max when the same number of chunks is measured
  again), the true mean taken as the measured one and the per-chunk sd read back from the recorded CI;
- speed (`speed_pass_probability`): at the measured ratio and per-round noise, the
  share of seeded simulated point runs that the real sequential test (speed_verdicts.sequential_look)
  passes within max_rounds.
The last two say "would this verdict come out again", not "would a harmless variant pass".
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist

import numpy as np

from gates.judging import speed_verdicts as V

DEFAULT_FLIP_RATE = 0.10  # per-item answer changes of a harmless variant when none was measured (docs/gates.md)
DEFAULT_SECONDS_PER_ITEM = 0.15  # eval time per item and model when none is given (docs/gates.md)
REFUSAL_POWER = 0.80
CI_ALPHA = 0.05  # evals.compare's default: the gates judge 95 % CIs
_NORMAL = NormalDist()
_Z95 = _NORMAL.inv_cdf(1 - CI_ALPHA / 2)
SPEED_DRAWS = 300  # simulated point runs per speed gate: the figure's sd is <= 0.03
SPEED_SEED = 0


@dataclass(frozen=True)
class GatePower:
    task: str
    n: int
    max_drop: float
    sd: float  # per-item sd of the paired difference of a harmless variant
    flip_rate: float | None  # None: a continuous metric, sd from its CI
    harmless_pass: float  # P(a variant equal to the baseline passes this gate)
    refusal80_drop: float  # the drop this gate refuses with probability REFUSAL_POWER
    underpowered: bool = False

    def line(self) -> str:
        source = f"flip rate {self.flip_rate:.3g}" if self.flip_rate is not None else f"item sd {self.sd:.3g}"
        return (f"harmless-pass {self.harmless_pass:.3f}, refuses a drop of {self.refusal80_drop:.3g} with "
                f"{REFUSAL_POWER:.0%} probability (n={self.n}, {source})")


def z_two_sided(alpha: float = CI_ALPHA) -> float:
    return _Z95 if alpha == CI_ALPHA else _NORMAL.inv_cdf(1 - alpha / 2)


def item_sd(flip_rate: float, drop: float = 0.0) -> float:
    """sd of the per-item paired difference under the flip model (binary tasks)."""
    if not 0.0 <= flip_rate <= 1.0:
        raise ValueError(f"flip_rate must be a fraction in [0, 1], got {flip_rate}")
    return math.sqrt(max(flip_rate + abs(drop) - drop * drop, 0.0))


def capped_flip_rate(flip_rate: float, baseline_score: float | None) -> float:
    """A harmless variant flips at most 2 * min(score, 1 - score) of the items (half each way)."""
    if baseline_score is None or not 0.0 <= baseline_score <= 1.0:
        return flip_rate
    return min(flip_rate, 2 * min(baseline_score, 1 - baseline_score))


def lattice_margin(n: int, max_drop: float) -> float:
    """max_drop with a half-step continuity correction: a binary task's deltas are multiples of 1/n and
    the gate admits a bound exactly at -max_drop, so a bound passes when it is above the half-step below
    the last multiple of 1/n within max_drop."""
    return (math.floor(max_drop * n + 1e-9) + 0.5) / n


def pass_probability(n: int, max_drop: float, drop: float = 0.0, flip_rate: float | None = None,
                     sd: float | None = None, alpha: float = CI_ALPHA) -> float:
    """P(the gate passes) for a variant `drop` worse than the baseline (0: harmless); a binary task
    gives `flip_rate`, a continuous one its per-item `sd`."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    spread = item_sd(flip_rate, drop) if flip_rate is not None else sd
    if spread is None or spread < 0:
        raise ValueError("give a flip_rate (binary task) or a per-item sd >= 0 (continuous metric)")
    margin = (lattice_margin(n, max_drop) if flip_rate is not None else max_drop) - drop
    if spread == 0.0:
        return 1.0 if margin >= 0 else 0.0
    return _NORMAL.cdf(margin * math.sqrt(n) / spread - z_two_sided(alpha))


def refusal_drop(n: int, max_drop: float, flip_rate: float | None = None, sd: float | None = None,
                 power: float = REFUSAL_POWER, alpha: float = CI_ALPHA) -> float:
    """The smallest drop the gate refuses with probability `power` (0 when it refuses even a harmless
    variant that often). Closed form for a continuous metric; bisection under the flip model, where
    the spread grows with the drop."""
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    if flip_rate is None:
        if sd is None:
            raise ValueError("give a flip_rate (binary task) or a per-item sd (continuous metric)")
        drop = max_drop - (z_two_sided(alpha) - _NORMAL.inv_cdf(power)) * sd / math.sqrt(n)
        return max(drop, 0.0)
    if pass_probability(n, max_drop, 0.0, flip_rate, alpha=alpha) <= 1 - power:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(32):  # to 1e-9 of a score
        mid = (low + high) / 2
        if pass_probability(n, max_drop, mid, flip_rate, alpha=alpha) > 1 - power:
            low = mid
        else:
            high = mid
    return high


def gate_power(task: str, n: int, max_drop: float, flip_rate: float | None = None, sd: float | None = None,
               min_harmless_pass: float | None = None, alpha: float = CI_ALPHA) -> GatePower:
    harmless = pass_probability(n, max_drop, 0.0, flip_rate, sd, alpha)
    spread = item_sd(flip_rate) if flip_rate is not None else float(sd)
    return GatePower(task=task, n=n, max_drop=max_drop, sd=spread, flip_rate=flip_rate, harmless_pass=harmless,
                     refusal80_drop=refusal_drop(n, max_drop, flip_rate, sd, alpha=alpha),
                     underpowered=min_harmless_pass is not None and harmless < min_harmless_pass)


def safety_power(name: str, n: int, max_change: float, rate: float, flip_rate: float | None,
                 min_harmless_pass: float | None) -> GatePower:
    """A safety gate (a point difference of rates over n pooled items, no CI: z = 0) at the baseline's rate."""
    flips = capped_flip_rate(DEFAULT_FLIP_RATE if flip_rate is None else flip_rate, rate)
    return gate_power(name, n, max_change, flip_rate=flips, min_harmless_pass=min_harmless_pass, alpha=1.0)


def long_context_power(length: int, n: int, max_drop: float, baseline_accuracy: float,
                       min_harmless_pass: float | None) -> GatePower:
    """A long-context gate: each probe retrieved independently with the baseline's accuracy (binomial)."""
    p = min(max(baseline_accuracy, 0.0), 1.0)
    return gate_power(f"long_context/{length}", n, max_drop, flip_rate=2 * p * (1 - p),
                      min_harmless_pass=min_harmless_pass)


def fidelity_power(name: str, chunks: int, limit: float, point: float, ci_low: float, ci_high: float,
                   min_harmless_pass: float | None) -> GatePower:
    """A fidelity gate at its measured effect: P(CI high <= limit on `chunks` fresh chunks) if the true mean is
    `point`; the per-chunk sd from the recorded CI's width (normal approximation of the cluster bootstrap).
    `refusal80_drop` holds the true mean the gate refuses with REFUSAL_POWER probability."""
    se = max(ci_high - ci_low, 0.0) / (2 * _Z95)
    sd = se * math.sqrt(chunks)
    if se == 0.0:
        harmless = 1.0 if point <= limit else 0.0
    else:
        harmless = _NORMAL.cdf((limit - point) / se - _Z95)
    refused = limit - (_Z95 - _NORMAL.inv_cdf(REFUSAL_POWER)) * se
    return GatePower(name, chunks, limit, sd, None, harmless, refused,
                     min_harmless_pass is not None and harmless < min_harmless_pass)


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


def speed_powers(policy, variant, max_rounds: int | None = None) -> dict[str, GatePower]:
    """Per speed gate with a recorded CI: its pass probability at the measured ratio and per-round noise
    (`refusal80_drop` is NaN: no closed form, and a search over simulations costs more than the figure is worth)."""
    from gates import metric_names as M

    out: dict[str, GatePower] = {}
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
            out[gate_name] = GatePower(gate_name, int(n), threshold, sd, None, p, float("nan"),
                                         policy.min_harmless_pass is not None and p < policy.min_harmless_pass)
    return out


def family_harmless_pass(powers: Sequence[GatePower]) -> float:
    """P(a harmless variant passes every gate), gates independent (disjoint items)."""
    return math.prod(p.harmless_pass for p in powers)


def flip_rates(comparison: Mapping) -> dict[str, float]:
    """Per task: (right->wrong + wrong->right) / n of one variant, from a compare.json."""
    rates: dict[str, float] = {}
    for row in comparison.get("rows", []):
        if row.get("binary") and row.get("n"):
            rates[row["task"]] = (len(row.get("lost", [])) + len(row.get("gained", []))) / row["n"]
    return rates


def _is_binary(task: str) -> bool:
    try:
        from evals.tasks import TASKS
    except ImportError:  # gates used without evals installed
        return True
    spec = TASKS.get(task)
    return spec is None or spec.binary


def task_powers(policy, variant: Mapping[str, float], baseline: Mapping[str, float],
                measured_flip_rates: Mapping[str, float] | None = None) -> dict[str, GatePower]:
    """The power of every task gate at its recorded n and baseline score (tasks without n: none)."""
    from gates import metric_names as M

    rates = measured_flip_rates or {}
    z = z_two_sided()
    powers: dict[str, GatePower] = {}
    for task in sorted(M.tasks_in(variant) | M.tasks_in(baseline)):
        n = variant.get(M.task_key(task, "n"), baseline.get(M.task_key(task, "n")))
        if not n:
            continue
        gate = policy.task_gate(task)
        if _is_binary(task):
            rate = capped_flip_rate(rates.get(task, DEFAULT_FLIP_RATE), baseline.get(M.task_score(task)))
            powers[task] = gate_power(task, int(n), gate.max_drop, flip_rate=rate,
                                      min_harmless_pass=policy.min_harmless_pass)
            continue
        low, high = variant.get(M.task_delta_ci_low(task)), variant.get(M.task_delta_ci_high(task))
        if low is not None and high is not None:
            sd = (high - low) / (2 * z) * math.sqrt(n)
            powers[task] = gate_power(task, int(n), gate.max_drop, sd=sd, min_harmless_pass=policy.min_harmless_pass)
    return powers


def with_power(results: list, powers: Mapping[str, GatePower]) -> list:
    """Task gate results (gates.records.evaluation.GateResult) with their power figures; verdicts unchanged."""
    out = []
    for r in results:
        task = r.name[len("task/"):-len("/max_drop")] if r.name.startswith("task/") else None
        p = powers.get(task) if task else None
        out.append(r if p is None else replace(r, harmless_pass=p.harmless_pass, refusal80_drop=p.refusal80_drop,
                                               underpowered=p.underpowered))
    return out


def _pooled(metric: str, base: Mapping[str, float], rates: Mapping[str, float]) -> tuple[int, float | None]:
    """The safety rate's pooled n over the refusal tasks scored by `metric`, and their n-weighted flip rate."""
    from gates import metric_names as M

    try:
        from evals.tasks import TASKS
    except ImportError:  # gates used without evals installed: no way to tell which tasks pool
        return 0, None
    sizes = {t: int(base[M.task_key(t, "n")]) for t in M.tasks_in(base)
             if t in TASKS and TASKS[t].metric == metric and base.get(M.task_key(t, "n"))}
    measured = {t: rates[t] for t in sizes if t in rates}
    weight = sum(sizes[t] for t in measured)
    return sum(sizes.values()), (sum(rates[t] * sizes[t] for t in measured) / weight if weight else None)


def family_powers(policy, variant: Mapping[str, float], base: Mapping[str, float],
                  measured_flip_rates: Mapping[str, float] | None = None) -> dict[str, GatePower]:
    """gate name -> power of every safety, fidelity and long-context gate whose inputs were recorded (the
    speed gates' are simulated: speed_powers)."""
    from gates import metric_names as M
    from gates.judging import fidelity_gates as G

    rates, out, floor = measured_flip_rates or {}, {}, policy.min_harmless_pass
    for key, limit, name, metric in (
            (M.SAFETY_REFUSAL_RATE, policy.refusal_rate_max_fall, "safety/refusal_rate/max_fall", "refusal_rate"),
            (M.SAFETY_OVER_REFUSAL_RATE, policy.over_refusal_rate_max_rise, "safety/over_refusal_rate/max_rise",
             "over_refusal_rate")):
        n, flips = _pooled(metric, base, rates)
        if limit is not None and n and key in base:
            out[name] = safety_power(name, n, limit, base[key], flips, floor)
    fid = policy.fidelity
    for key, limit, name in ((G.FIDELITY_KL, fid.max_kl, "fidelity/kl/max"),
                             (G.FIDELITY_FLIP_RATE, fid.max_flip_rate, "fidelity/flip_rate/max")):
        low, high = variant.get(G.ci_key(key, "low")), variant.get(G.ci_key(key, "high"))
        if limit is not None and low is not None and high is not None and key in variant:
            out[name] = fidelity_power(name, fid.chunks, limit, variant[key], low, high, floor)
    if policy.long_context.max_drop is not None:
        for length in G.probed_lengths(variant):
            n, acc = (variant.get(G.long_context_key(length, f)) for f in ("n", "baseline"))
            if n and acc is not None:
                gate = f"long_context/{length}/max_drop"
                out[gate] = replace(long_context_power(length, int(n), policy.long_context.max_drop, acc, floor),
                                    task=gate)
    return out


def with_gate_power(results: list, powers: Mapping[str, GatePower]) -> list:
    """Gate results (any family) with the power figure recorded under their gate name; verdicts unchanged."""
    return [r if (p := powers.get(r.name)) is None else
            replace(r, harmless_pass=p.harmless_pass, refusal80_drop=p.refusal80_drop, underpowered=p.underpowered)
            for r in results]


def recorded_flip_rates(client, run_id: str) -> dict[str, float]:
    """Flip rates from the variant run's `evidence/compare.json` ({} when it has none)."""
    import json
    import tempfile

    from mlflow.exceptions import MlflowException

    from gates.metric_names import EVIDENCE_DIR

    with tempfile.TemporaryDirectory(prefix="quantgate-power-") as tmp:
        try:
            path = client.download_artifacts(run_id, f"{EVIDENCE_DIR}/compare.json", tmp)
            return flip_rates(json.loads(Path(path).read_text()))
        except (MlflowException, OSError, ValueError, KeyError):  # recorded without its comparison
            return {}


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


POWER_FIELDS = ("harmless_pass", "refusal80_drop", "underpowered")


def power_tags(result) -> dict[str, str]:
    """A gate result's power figures as `gate/<name>/<field>` tag values (none for gates without them)."""
    if result.harmless_pass is None:
        return {}
    return {"harmless_pass": repr(result.harmless_pass), "refusal80_drop": repr(result.refusal80_drop),
            "underpowered": "true" if result.underpowered else "false"}


def power_from_tags(tags: Mapping[str, str], key) -> dict:
    """The GateResult fields `power_tags` wrote, read back (`key(field)` names the tag)."""
    if key("harmless_pass") not in tags:
        return {}
    return {"harmless_pass": float(tags[key("harmless_pass")]), "refusal80_drop": float(tags[key("refusal80_drop")]),
            "underpowered": tags.get(key("underpowered")) == "true"}


def power_cell(result) -> str:
    if result.harmless_pass is None:
        return "—"
    label = " **underpowered**" if result.underpowered else ""
    refused = result.refusal80_drop
    return f"{result.harmless_pass:.2f} / {'—' if refused is None or math.isnan(refused) else f'{refused:.3g}'}{label}"


def family_line(results: Sequence) -> str:
    """The report's line on power: the family's harmless-pass probability and the underpowered gates."""
    gates = [r for r in results if r.harmless_pass is not None]
    if not gates:
        return "power: no gate with a recorded n"
    weak = [f"`{r.name}`" for r in gates if r.underpowered]
    line = (f"power (column: P(pass) / the effect refused with {REFUSAL_POWER:.0%} probability; tasks, safety, "
            f"long context: a variant equal to the baseline; fidelity, speed: at the measured effect, docs/gates.md "
            f"\"Power\"): all {len(gates)} gates with a figure pass together with probability "
            f"{math.prod(r.harmless_pass for r in gates):.3f} (gates independent)")
    return line + (f"; underpowered (reported, never blocks): {', '.join(weak)}" if weak else "")


def family_metric(results: Sequence, key: str) -> dict[str, float]:
    gates = [r.harmless_pass for r in results if r.harmless_pass is not None]
    return {key: math.prod(gates)} if gates else {}
