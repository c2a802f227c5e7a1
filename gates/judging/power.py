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

Where each part lives (every name stays importable from here): gates.judging.power_gates (one gate's power, closed
form, tasks to fidelity), gates.judging.power_speed (the speed gates' simulated power), gates.judging.power_plan
(`--plan`'s n per task) and gates.judging.power_report (the figures on gate results, tags and reports).
"""

from __future__ import annotations

from gates.judging.power_gates import (
    _NORMAL,
    _Z95,
    CI_ALPHA,
    DEFAULT_FLIP_RATE,
    REFUSAL_POWER,
    GatePower,
    capped_flip_rate,
    family_harmless_pass,
    family_powers,
    fidelity_power,
    flip_rates,
    gate_power,
    item_sd,
    lattice_margin,
    long_context_power,
    pass_probability,
    refusal_drop,
    safety_power,
    task_powers,
    z_two_sided,
)
from gates.judging.power_plan import (
    DEFAULT_SECONDS_PER_ITEM,
    Plan,
    PlanRow,
    PlanTask,
    needed_n,
    plan,
    plan_markdown,
)
from gates.judging.power_report import (
    POWER_FIELDS,
    family_line,
    family_metric,
    power_cell,
    power_from_tags,
    power_tags,
    recorded_flip_rates,
    with_gate_power,
    with_power,
)
from gates.judging.power_speed import (
    SPEED_DRAWS,
    SPEED_SEED,
    design_of,
    round_sd,
    speed_pass_probability,
    speed_powers,
)

__all__ = [
    "CI_ALPHA",
    "DEFAULT_FLIP_RATE",
    "DEFAULT_SECONDS_PER_ITEM",
    "GatePower",
    "POWER_FIELDS",
    "Plan",
    "PlanRow",
    "PlanTask",
    "REFUSAL_POWER",
    "SPEED_DRAWS",
    "SPEED_SEED",
    "_NORMAL",
    "_Z95",
    "capped_flip_rate",
    "design_of",
    "family_harmless_pass",
    "family_line",
    "family_metric",
    "family_powers",
    "fidelity_power",
    "flip_rates",
    "gate_power",
    "item_sd",
    "lattice_margin",
    "long_context_power",
    "needed_n",
    "pass_probability",
    "plan",
    "plan_markdown",
    "power_cell",
    "power_from_tags",
    "power_tags",
    "recorded_flip_rates",
    "refusal_drop",
    "round_sd",
    "safety_power",
    "speed_pass_probability",
    "speed_powers",
    "task_powers",
    "with_gate_power",
    "with_power",
    "z_two_sided",
]
