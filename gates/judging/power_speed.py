"""Power of the speed gates: the probability that the group-sequential paired test
(gates.judging.speed_verdicts.sequential_look) passes a variant at its measured ratio and per-round noise within
the round budget, by seeded simulation through the real test."""

from __future__ import annotations

import functools
import math
import re

import numpy as np

from gates.judging import speed_verdicts as V
from gates.judging.power_gates import GatePower

SPEED_DRAWS = 300  # simulated point runs per speed gate: the figure's sd is <= 0.03
SPEED_SEED = 0


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
