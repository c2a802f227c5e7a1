"""gates/evidence/speed_replay.py: verify replays the group-sequential speed rounds of a speed.json.

The records are made by the release's own loop (flows.speed_rounds.sequential_rounds and
sequential_metrics) on crafted timings, written in the layout flows.speed_rounds.measure writes; the
replayed metrics must be the ones the release logged, and rounds, looks or CIs that the sequential test
does not imply must be reported naming their gate. No MLflow (tests/test_evidence_speed.py: end to end).
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from flows.data import BASELINE, SpeedPlan
from flows.speed_rounds import merge_pairs, sequential_metrics, sequential_rounds
from gates.evidence import rederive as R
from gates.evidence import speed_replay as S
from gates.judging.speed_verdicts import SequentialDesign, spent

PLAN = SpeedPlan(decode_batches=(1, 4), decode_tokens=8, decode_context=32, prefill_tokens=64, long_context=128,
                 rounds=9, look_every=3, min_decode=1.0, min_prefill=1.0, warmup_rounds=0)
DESIGN = SequentialDesign(PLAN.look_every, PLAN.rounds, PLAN.alpha, PLAN.spending)
# variant -> its true speed ratio and per-round noise: clearly faster, clearly slower, straddling the minimum
TRUTH = {"fast": (1.5, 0.02), "slow": (0.6, 0.02), "close-kv8": (1.0, 0.05)}


def timer(name: str, point: str, round_: int) -> float:
    ratio, noise = TRUTH.get(name, (1.0, 0.02))
    rng = random.Random(zlib.crc32(f"{name}/{point}/{round_}".encode()))
    return 100.0 * ratio * math.exp(rng.gauss(0.0, noise))


def _units(variants: list[str]) -> dict[str, list[str]]:
    units = {p: list(variants) for p in PLAN.points()}
    kv = [v for v in variants if v.endswith("-kv8")]
    units.update({p: kv for p in PLAN.points(kv=True) if p not in units and kv})
    return units


def _looks_json(looks) -> dict:
    return {f"{v}/{p}": {"rounds": k.ci.n, "level": k.level, "decision": k.decision, "estimate": k.ci.estimate,
                         "low": k.ci.low, "high": k.ci.high} for (v, p), k in sorted(looks.items())}


def _minimums(units) -> dict:
    return {p: PLAN.minimum(p) for p in units}


def joint(plan: SpeedPlan = PLAN, clock=None) -> tuple[dict, dict]:
    """Every model in one run of rounds (speed.json without `pairs`), and the metrics the flow logs."""
    variants = list(TRUTH)
    units = _units(variants)
    kwargs = {"clock": clock} if clock else {}
    speeds, looks = sequential_rounds([BASELINE, *variants], units, timer, DESIGN, _minimums(units), 0, plan.time_budget_s,
                                      **kwargs)
    metrics = sequential_metrics(speeds, looks, plan)
    return {"plan": asdict(plan), "points": {p: plan.shape(p) for p in units}, "design": asdict(DESIGN),
            "rounds": speeds, "looks": _looks_json(looks), "metrics": metrics}, metrics


def paired() -> tuple[dict, dict]:
    """The baseline against each variant in turn (speed.json with `pairs`, the baseline's rounds concatenated)."""
    pairs, looks, metrics = {}, {}, {}
    for v in TRUTH:
        units = _units([v])
        pairs[v], pair_looks = sequential_rounds([BASELINE, v], units, timer, DESIGN, _minimums(units), 0)
        looks.update(pair_looks)
        metrics[v] = sequential_metrics(pairs[v], pair_looks, PLAN)[v]
    merged, units = merge_pairs(pairs), _units(list(TRUTH))
    return {"plan": asdict(PLAN), "points": {p: PLAN.shape(p) for p in units}, "design": asdict(DESIGN),
            "rounds": merged, "pairs": pairs, "looks": _looks_json(looks), "metrics": metrics}, metrics


def _derive(tmp_path: Path, record: dict, variant: str) -> R.Derived:
    (tmp_path / R.SPEED_FILE).write_text(json.dumps(record))
    return R.derive_pair(None, tmp_path, variant, BASELINE)


def _same_metrics(derived: R.Derived, logged: dict[str, float]) -> None:
    assert not derived.problems, derived.problems
    assert derived.metrics.keys() == logged.keys()
    for key, value in logged.items():
        assert derived.metrics[key] == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize("layout", [joint, paired])
def test_the_replayed_rounds_give_the_metrics_the_release_logged(tmp_path, layout):
    record, logged = layout()
    decisions = {k: v["decision"] for k, v in record["looks"].items()}
    assert decisions["fast/decode_b1"] == "pass" and decisions["slow/prefill"] == "fail"
    assert record["looks"]["fast/decode_b1"]["rounds"] == 3  # stopped at the first look
    assert "close-kv8/long_decode_b1" in decisions and "fast/long_decode_b1" not in decisions
    for variant in TRUTH:
        derived = _derive(tmp_path, record, variant)
        _same_metrics(derived, logged[variant])
        assert any("group-sequential" in f for f in derived.families)
    derived = _derive(tmp_path, record, "close-kv8")
    assert R.rederived("serve/min_decode_speedup/long_b1", derived, None)
    del record["design"]  # the plan's own look fields make the same design
    _same_metrics(_derive(tmp_path, record, "close-kv8"), logged["close-kv8"])
    assert R.rederived("serve/min_prefill_speedup", derived, None)


@pytest.mark.parametrize(("budget", "ended"), [(9.0, 5), (12.0, 6)])  # between looks; at a look, read as final
def test_a_run_the_budget_ended_replays_its_final_look(tmp_path, budget, ended):
    ticks = iter(range(10**6))
    record, logged = joint(replace(PLAN, time_budget_s=budget), lambda: float(next(ticks)))  # a round: 2 ticks
    assert max(len(v) for v in record["rounds"][BASELINE].values()) == ended < DESIGN.max_rounds
    assert record["looks"]["close-kv8/decode_b1"]["decision"] == "uninformative"  # the budget's final look
    for variant in TRUTH:
        _same_metrics(_derive(tmp_path, record, variant), logged[variant])


def test_the_first_look_is_the_independent_pocock_t_interval(tmp_path):
    from scipy import stats

    record, _ = joint()
    base, fast = record["rounds"][BASELINE]["decode_b4"][:3], record["rounds"]["fast"]["decode_b4"]
    assert len(fast) == 3
    logs = [math.log(v / b) for v, b in zip(fast, base, strict=True)]
    level = 1 - spent("pocock", 3 / 9, 0.05)  # one look so far: it spends exactly the Pocock share of alpha
    mean, sd = sum(logs) / 3, float(stats.tstd(logs))
    half = stats.t.ppf((1 + level) / 2, 2) * sd / math.sqrt(3)
    derived = _derive(tmp_path, record, "fast")
    assert derived.metrics["serve/point/decode_b4/ci_level"] == pytest.approx(level, abs=2e-4)  # the gridded recursion
    assert derived.metrics["serve/decode_speedup_b4_ci_low"] == pytest.approx(math.exp(mean - half), rel=1e-3)
    assert derived.metrics["serve/decode_speedup_b4_ci_high"] == pytest.approx(math.exp(mean + half), rel=1e-3)


def test_rounds_timed_past_a_decision_or_ended_undecided_are_problems_naming_the_gate(tmp_path):
    record, _ = joint()
    assert len(record["rounds"][BASELINE]["decode_b1"]) > 3  # the baseline went on with close-kv8
    record["rounds"]["fast"]["decode_b1"].append(150.0)  # a fourth round after fast stopped at the first look
    problems = _derive(tmp_path, record, "fast").problems
    assert any(p.startswith("gate serve/min_decode_speedup/b1: fast has 4 rounds at decode_b1, but the sequential "
                            "test on them decides at round 3 (pass)") for p in problems), problems
    record, _ = joint()
    record["rounds"]["fast"]["prefill"][1] = 60.0  # its first look now straddles: it should have gone on
    problems = _derive(tmp_path, record, "fast").problems
    assert any(p.startswith("gate serve/min_prefill_speedup: fast has 3 rounds at prefill") for p in problems), problems


def test_a_look_recorded_in_speed_json_that_the_rounds_do_not_give_is_a_problem(tmp_path):
    record, _ = joint()
    record["looks"]["slow/decode_b4"]["high"] = 1.2
    problems = _derive(tmp_path, record, "slow").problems
    assert any(p.startswith("gate serve/min_decode_speedup/b4: speed.json's look for slow/decode_b4 records high 1.2")
               for p in problems), problems


def test_speed_metric_keys_name_their_gates():
    assert R.gate_of("serve/long_decode_speedup_b1_ci_low") == "serve/min_decode_speedup/long_b1"
    assert R.gate_of("serve/point/long_decode_b1/rounds") == "serve/min_decode_speedup/long_b1"
    assert R.gate_of("serve/paired_long_decode_b1_tps") == "serve/min_decode_speedup/long_b1"
    assert R.gate_of("serve/point/decode_b16/ci_level") == "serve/min_decode_speedup/b16"
    assert R.gate_of("serve/point/prefill/prompt_tokens") == "serve/min_prefill_speedup"
    assert S.gate_name("long_decode_b2") == "serve/min_decode_speedup/long_b2"
