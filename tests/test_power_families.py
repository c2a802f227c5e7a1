"""Power of the safety, long-context, fidelity and speed gates (gates.judging.power.family_powers,
gates.judging.power.speed_powers), checked against simulations through the real gate code where the
figure claims to model it, and attached to every gate by gates.judging.judge.judge (reported, never a verdict).

Pass rates from 200 draws have sd <= 0.035, so closed forms are checked within 0.06 (about 2 sd)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gates import metric_names as M
from gates.judging import fidelity_gates as G
from gates.judging import power as P
from gates.judging import speed_verdicts as V
from gates.judging.judge import judge
from gates.judging.policy import parse_policy

POLICY = parse_policy({"tasks": {"max_drop": 0.05}, "safety": {"refusal_rate_max_fall": 0.05},
                       "long_context": {"max_drop": 0.2}, "fidelity": {"max_kl": 0.1, "chunks": 16},
                       "serving": {"min_decode_speedup": 1.0, "decode_batches": [1], "min_prefill_speedup": None,
                                   "max_tpot_p99_s": None},
                       "power": {"min_harmless_pass": 0.8}})
DRAWS = 200


def _gate(results, name: str):
    return next(r for r in results if r.name == name)


def test_safety_power_matches_the_real_gate_on_simulated_refusals() -> None:
    n, p, flips, max_fall = 120, 0.6, 0.10, 0.05  # advbench-sized pooled items
    rng = np.random.default_rng(7)
    passed = []
    for _ in range(DRAWS):
        base = rng.random(n) < p
        u = rng.random(n)  # a harmless variant: flips half each way, refusal rate unchanged on average
        var = np.where(base, u >= (flips / 2) / p, u < (flips / 2) / (1 - p))
        metrics_b = {M.SAFETY_REFUSAL_RATE: base.mean(), **M.task_metrics("advbench", base.mean(), n=n)}
        results = judge(POLICY, {M.SAFETY_REFUSAL_RATE: var.mean()}, metrics_b, flip_rates={"advbench": flips})
        passed.append(_gate(results, "safety/refusal_rate/max_fall").passed)
    model = P.safety_power("s", n, max_fall, p, flips, None).harmless_pass
    assert 0.8 < model < 0.99
    assert abs(model - np.mean(passed)) <= 0.06, (model, np.mean(passed))
    assert _gate(results, "safety/refusal_rate/max_fall").harmless_pass == pytest.approx(
        P.safety_power("s", n, max_fall, base.mean(), flips, None).harmless_pass)


def test_long_context_power_matches_the_real_bootstrap_and_gate() -> None:
    from evals import long_context as L

    n, p = 30, 0.8
    rng = np.random.default_rng(11)
    passed = []
    for _ in range(DRAWS):
        b, v = rng.random(n) < p, rng.random(n) < p  # binomial per probe at the baseline's accuracy
        base = [L.ProbeAnswer(1024, 0.5, str(i), "", bool(x)) for i, x in enumerate(b)]
        var = [L.ProbeAnswer(1024, 0.5, str(i), "", bool(x)) for i, x in enumerate(v)]
        row = L.compare(base, var, n_boot=400)[1024]
        metrics = {G.long_context_key(1024, f): float(x) for f, x in
                   (("baseline", row.baseline), ("variant", row.variant), ("delta", row.delta),
                    ("delta_ci_low", row.ci_low), ("delta_ci_high", row.ci_high), ("n", row.n))}
        passed.append(_gate(judge(POLICY, metrics, {}), "long_context/1024/max_drop").passed)
    model = P.long_context_power(1024, n, 0.2, p, None).harmless_pass
    assert abs(model - np.mean(passed)) <= 0.07, (model, np.mean(passed))


def test_fidelity_power_is_the_pass_probability_at_the_measured_effect() -> None:
    chunks, sd, limit = 16, 0.04, 0.10
    se = sd / math.sqrt(chunks)
    z = P.z_two_sided()
    rng = np.random.default_rng(3)
    for mean in (0.05, 0.07, 0.08):
        means = rng.normal(mean, sd, size=(4000, chunks)).mean(axis=1)  # re-measured on fresh chunks
        simulated = np.mean(means + z * se <= limit)
        figure = P.fidelity_power("fidelity/kl/max", chunks, limit, mean, mean - z * se, mean + z * se, None)
        assert figure.sd == pytest.approx(sd)
        assert abs(figure.harmless_pass - simulated) <= 0.03, (mean, figure.harmless_pass, simulated)
    at_edge = P.fidelity_power("f", chunks, limit, limit - z * se, limit - 2 * z * se, limit, None)
    assert at_edge.harmless_pass == pytest.approx(0.5)


def test_round_sd_reads_back_the_rounds_sd() -> None:
    ratios = [1.1, 1.2, 0.95, 1.05, 1.15, 1.0, 1.12]
    sd = float(np.std(np.log(ratios), ddof=1))
    design = V.SequentialDesign(5, 20)
    look = V.sequential_look(ratios, 1.0, design)
    assert P.round_sd(look.ci.low, look.ci.high, len(ratios), look.level) == pytest.approx(sd, rel=1e-6)


def test_speed_power_simulates_the_sequential_test() -> None:
    design = P.design_of(POLICY)
    clear = P.speed_pass_probability(1.30, 0.05, 1.0, design)
    at_min = P.speed_pass_probability(1.00, 0.05, 1.0, design)
    near = P.speed_pass_probability(1.03, 0.08, 1.0, design)
    assert clear == 1.0 and at_min <= 0.06 and 0.05 < near < 0.95
    assert P.speed_pass_probability(1.03, 0.08, 1.0, design) == near  # seeded: the same figure every time
    assert P.speed_pass_probability(1.03, 0.08, 1.0, design, max_rounds=5) < near  # a budget of one look


def _all_families() -> tuple[dict, dict]:
    variant = {**M.task_metrics("arc_easy", 0.6, delta=0.0, ci_low=-0.03, ci_high=0.03, n=500),
               M.SAFETY_REFUSAL_RATE: 0.6, G.FIDELITY_KL: 0.02, G.ci_key(G.FIDELITY_KL, "low"): 0.015,
               G.ci_key(G.FIDELITY_KL, "high"): 0.025,
               **{G.long_context_key(2048, f): x for f, x in (("baseline", 0.9), ("variant", 0.9), ("delta", 0.0),
                                                              ("delta_ci_low", -0.1), ("delta_ci_high", 0.1),
                                                              ("n", 10))},
               M.decode_speedup(1): 1.02, M.ci(M.decode_speedup(1), "ci_low"): 0.97,
               M.ci(M.decode_speedup(1), "ci_high"): 1.07, M.speed_point("decode_b1", "rounds"): 20,
               M.speed_point("decode_b1", "ci_level"): 0.98}
    base = {**M.task_metrics("arc_easy", 0.6, n=500), M.SAFETY_REFUSAL_RATE: 0.6,
            **M.task_metrics("harmbench", 0.6, n=200)}
    return variant, base


def test_judge_attaches_power_to_every_family_and_never_changes_a_verdict() -> None:
    from gates.judging.gate_report import render_markdown
    from gates.judging.verdicts import Evaluation

    variant, base = _all_families()
    results = judge(POLICY, variant, base)
    names = ["task/arc_easy/max_drop", "safety/refusal_rate/max_fall", "fidelity/kl/max",
             "long_context/2048/max_drop", "serve/min_decode_speedup/b1", "task/harmbench/max_drop"]
    for name in names:
        assert _gate(results, name).harmless_pass is not None, name
    speed = _gate(results, "serve/min_decode_speedup/b1")
    assert speed.verdict == "uninformative" and speed.underpowered  # a straddling CI: little chance of a pass
    assert math.isnan(speed.refusal80_drop) and P.power_tags(speed)["refusal80_drop"] == "nan"
    lc = _gate(results, "long_context/2048/max_drop")
    assert lc.harmless_pass == pytest.approx(P.long_context_power(2048, 10, 0.2, 0.9, None).harmless_pass)
    assert P.family_metric(results, "k")["k"] == pytest.approx(math.prod(_gate(results, n).harmless_pass for n in names))
    without = judge(parse_policy({"tasks": {"max_drop": 0.05}, "safety": {"refusal_rate_max_fall": 0.05},
                                  "long_context": {"max_drop": 0.2}, "fidelity": {"max_kl": 0.1},
                                  "serving": {"min_decode_speedup": 1.0, "decode_batches": [1],
                                              "min_prefill_speedup": None, "max_tpot_p99_s": None},
                                  "power": {"min_harmless_pass": None}}), variant, base)
    assert [(r.name, r.passed, r.verdict) for r in without] == [(r.name, r.passed, r.verdict) for r in results]
    ev = Evaluation("r", "release", results, "now", "0" * 64, "p")
    report = render_markdown(ev, "v")
    assert "all 6 gates with a figure pass together" in report and "/ — **underpowered** |" in report
