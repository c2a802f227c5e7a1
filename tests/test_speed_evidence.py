"""Speed evidence a release can trust: paired interleaved rounds, a CI on the per-round ratio, three
outcomes (pass / fail / uninformative), the canary's paired windows, and measure-cache keys that see the
machine. Crafted timings throughout: no model, no sleeps."""

from __future__ import annotations

import math

import pytest

from flows.data import SpeedPlan, Variant
from flows.speed_rounds import paired_rounds, speed_metrics
from gates import metric_names as M
from gates.judging.judge import judge
from gates.judging.policy import parse_policy
from gates.judging.speed_verdicts import FAIL, PASS, outcome, ratio_ci
from gates.judging.verdicts import UNINFORMATIVE

NAMES = ["baseline", "fast", "slow"]
POINTS = SpeedPlan().points()  # prefill, decode_b1, decode_b4, decode_b16
POLICY = {"tasks": {"max_drop": 0.05},
          "serving": {"min_decode_speedup": 1.0, "min_prefill_speedup": 0.8, "decode_batches": [1, 4, 16]}}


def crafted(speed: dict[str, float], drift: list[float] | None = None, wobble: dict[str, list[float]] | None = None):
    """A timer: each model's tok/s, times the machine's drift in that round (the same for every model),
    times the model's own per-round wobble; records every call."""
    calls: list[tuple[str, str, int]] = []

    def timer(name: str, point: str, round_: int) -> float:
        calls.append((name, point, round_))
        if round_ < 0:
            return 1.0  # warm-up: never recorded
        d = drift[round_] if drift else 1.0
        w = wobble[name][round_] if wobble and name in wobble else 1.0
        return speed[name] * d * w

    return timer, calls


def _release_gates(metrics: dict[str, float], **sensitivity) -> dict:
    policy = parse_policy({**POLICY, **({"sensitivity": sensitivity} if sensitivity else {})})
    return {r.name: r for r in judge(policy, metrics, {}) if r.name.startswith("serve/")}


def test_a_variant_twice_as_fast_in_every_round_passes_every_speed_gate():
    timer, _ = crafted({"baseline": 20.0, "fast": 40.0, "slow": 10.0})
    metrics = speed_metrics(paired_rounds(NAMES, POINTS, timer, rounds=5))
    fast = metrics["fast"]
    assert fast[M.decode_speedup(4)] == pytest.approx(2.0)
    assert fast[M.ci(M.decode_speedup(4), "ci_low")] == pytest.approx(2.0)
    assert fast[M.SERVE_SPEED_ROUNDS] == 5 and fast[M.paired_tps("decode_b4")] == 40.0
    assert M.decode_speedup(1) not in metrics["baseline"]  # the baseline has speeds, not ratios
    gates = _release_gates(fast)
    assert set(gates) == {"serve/min_decode_speedup/b1", "serve/min_decode_speedup/b4",
                          "serve/min_decode_speedup/b16", "serve/min_prefill_speedup"}
    assert all(g.passed and g.verdict == PASS for g in gates.values())
    assert "2x (95% CI 2-2, 5 paired rounds): whole CI >= 1" in gates["serve/min_decode_speedup/b4"].reason


def test_a_variant_slower_in_every_round_is_refused_with_its_figures():
    timer, _ = crafted({"baseline": 20.0, "fast": 40.0, "slow": 10.0},
                       wobble={"slow": [1.0, 1.1, 0.9, 1.05, 0.95]})
    gates = _release_gates(speed_metrics(paired_rounds(NAMES, POINTS, timer, rounds=5))["slow"])
    for name in ("serve/min_decode_speedup/b1", "serve/min_prefill_speedup"):
        assert gates[name].verdict == FAIL and not gates[name].passed
        assert gates[name].observed == pytest.approx(0.5, rel=0.02)
        assert "whole CI < " in gates[name].reason and "5 paired rounds" in gates[name].reason


def test_rounds_straddling_the_threshold_are_uninformative_and_block_auto_approval():
    from flows.approval import auto_decision, blind_blockers
    from flows.data import VariantResult

    # the variant is 0.9x in some rounds and 1.1x in others: the CI straddles 1.0
    timer, _ = crafted({"baseline": 20.0, "fast": 20.0, "slow": 20.0},
                       wobble={"fast": [0.9, 1.1, 0.92, 1.08, 1.0]})
    metrics = speed_metrics(paired_rounds(NAMES, POINTS, timer, rounds=5))["fast"]
    low, high = metrics[M.ci(M.decode_speedup(1), "ci_low")], metrics[M.ci(M.decode_speedup(1), "ci_high")]
    assert low < 1.0 < high
    gates = _release_gates(metrics)
    b1 = gates["serve/min_decode_speedup/b1"]
    assert b1.verdict == UNINFORMATIVE and not b1.passed  # the `serving` family blocks by default
    assert "CI straddles 1: the machine's noise decides" in b1.reason and "(blocks)" in b1.reason
    assert gates["serve/min_prefill_speedup"].passed  # the same ratios clear 0.8 with their whole CI
    # in the flow: a row stopped by it is no auto-approval candidate, only offered to a person
    blocking = [g.name for g in gates.values() if not g.passed]
    row = VariantResult("fast", "int8wo", "run", "1", gates_passed=False, gates_total=len(gates),
                        gates_failed=blocking, gates_uninformative=blocking)
    candidates = [r.name for r in [row] if r.gates_passed]
    assert auto_decision(candidates).approved == {} and blind_blockers(row) == blocking
    # a policy may let it be reported instead
    reported = _release_gates(metrics, serving="report")["serve/min_decode_speedup/b1"]
    assert reported.verdict == UNINFORMATIVE and reported.passed and "reported, does not block" in reported.reason


def test_a_drift_that_slows_every_model_alike_leaves_the_paired_ratio_unchanged():
    drift = [1.0, 1.0, 0.4, 1.0, 1.0]  # round 3: the machine slows to 40 % for every model
    timer, _ = crafted({"baseline": 20.0, "fast": 30.0, "slow": 10.0}, drift=drift)
    metrics = speed_metrics(paired_rounds(NAMES, POINTS, timer, rounds=5))["fast"]
    key = M.decode_speedup(16)
    assert metrics[key] == pytest.approx(1.5)
    assert metrics[M.ci(key, "ci_low")] == pytest.approx(1.5) and metrics[M.ci(key, "ci_high")] == pytest.approx(1.5)
    assert metrics[M.paired_tps("decode_b16")] == 30.0  # the model's own median shrugs the round off too
    # unpaired, the drifted round would look like a 0.6x variant against a baseline of another round
    assert 30.0 * 0.4 / 20.0 == pytest.approx(0.6)


def test_rounds_interleave_models_rotate_order_and_warm_up_untimed():
    timer, calls = crafted({"baseline": 20.0, "fast": 40.0})
    speeds = paired_rounds(["baseline", "fast"], ["decode_b1"], timer, rounds=3, warmup=1)
    assert calls[:2] == [("baseline", "decode_b1", -1), ("fast", "decode_b1", -1)]  # warm-up first, untimed
    timed = [(n, r) for n, _, r in calls[2:]]
    assert timed == [("baseline", 0), ("fast", 0), ("fast", 1), ("baseline", 1), ("baseline", 2), ("fast", 2)]
    assert speeds["fast"]["decode_b1"] == [40.0, 40.0, 40.0]
    with pytest.raises(ValueError, match="at least 2 paired rounds"):
        paired_rounds(["baseline"], ["prefill"], timer, rounds=1)


def test_ratio_ci_and_the_three_outcomes():
    ci = ratio_ci([2.0, 0.5])
    assert ci.estimate == pytest.approx(1.0) and ci.n == 2  # geometric mean: 2x and 0.5x average to 1x
    assert ci.low < 1.0 < ci.high
    logs = [math.log(r) for r in (1.1, 1.2, 1.3)]
    half = 4.303 * (sum((x - sum(logs) / 3) ** 2 for x in logs) / 2) ** 0.5 / 3 ** 0.5
    assert ratio_ci([1.1, 1.2, 1.3]).low == pytest.approx(math.exp(sum(logs) / 3 - half))
    assert (outcome(1.1, 1.3, 1.0), outcome(0.7, 0.9, 1.0), outcome(0.9, 1.1, 1.0)) == (PASS, FAIL, UNINFORMATIVE)
    with pytest.raises(ValueError, match="at least 2"):
        ratio_ci([1.5])
    with pytest.raises(ValueError, match="finite and > 0"):
        ratio_ci([1.0, 0.0])


def test_a_ratio_without_a_ci_is_uninformative_and_a_missing_one_fails():
    key = M.decode_speedup(1)
    gates = _release_gates({key: 1.5, M.SERVE_SPEED_ROUNDS: 1})
    assert gates["serve/min_decode_speedup/b1"].verdict == UNINFORMATIVE
    assert "no CI (1 paired rounds" in gates["serve/min_decode_speedup/b1"].reason
    assert gates["serve/min_decode_speedup/b4"].verdict == "fail"
    assert gates["serve/min_decode_speedup/b4"].observed is None


# ---- the canary: the challenger against the champion, paired windows ------------------------------------


def _replay(champion_tpot: float, challenger_tpot: float, n: int = 24, slow_window: int | None = None) -> list[dict]:
    """Alternating versions; in `slow_window` the machine is 3x slower for both."""
    records = []
    for i in range(n):
        version = "champion" if i % 2 else "challenger"
        tpot = champion_tpot if version == "champion" else challenger_tpot
        if slow_window is not None and i // 4 == slow_window:
            tpot *= 3.0
        records.append({"id": i, "version": version, "tpot_s": tpot, "error": None})
    return records


def test_canary_windows_pair_the_versions_and_judge_three_ways():
    from flows.canary_stage import paired_windows, speed_comparison

    ratios = paired_windows(_replay(0.040, 0.020, slow_window=2))
    assert len(ratios) == 6 and ratios == pytest.approx([2.0] * 6)  # the slow window cancels within itself
    comparison = speed_comparison(_replay(0.040, 0.020))
    assert comparison["windows"] == 6 and comparison["ci_low"] == pytest.approx(2.0)

    policy = parse_policy({"tasks": {"max_drop": 0.05}, "canary": {"min_tpot_speedup": 0.8}})

    def canary_gate(comparison: dict):
        metrics = {M.CANARY_SPEED_WINDOWS: comparison["windows"], M.CANARY_TPOT_SPEEDUP: comparison["estimate"],
                   M.ci(M.CANARY_TPOT_SPEEDUP, "ci_low"): comparison["ci_low"],
                   M.ci(M.CANARY_TPOT_SPEEDUP, "ci_high"): comparison["ci_high"]}
        [gate] = judge(policy, metrics, None, stage="canary")
        return gate

    assert canary_gate(comparison).verdict == PASS
    assert canary_gate(speed_comparison(_replay(0.020, 0.040))).verdict == FAIL  # the challenger is 2x slower
    noisy = _replay(0.030, 0.030)
    window_ratios = [0.6, 1.0, 0.7, 1.0, 0.65, 0.95]  # around the 0.8 threshold, window by window
    for r in noisy:
        if r["version"] == "challenger":
            r["tpot_s"] /= window_ratios[r["id"] // 4]
    noisy_gate = canary_gate(speed_comparison(noisy))
    assert noisy_gate.verdict == UNINFORMATIVE and not noisy_gate.passed
    assert "paired windows" in noisy_gate.reason


def test_canary_windows_skip_those_missing_a_version():
    from flows.canary_stage import paired_windows, speed_comparison

    records = _replay(0.040, 0.020, n=8)
    for r in records[:4]:
        r["version"] = "champion"
    assert paired_windows(records, windows=2) == pytest.approx([2.0])
    one = speed_comparison(records, windows=2)
    assert one["windows"] == 1 and "ci_low" not in one  # too few windows for a CI: uninformative at the gate


# ---- the measure caches see the machine ----------------------------------------------------------------


@pytest.fixture
def machine_of(monkeypatch):
    """Set what `serving.kernels.cpu` reports for this machine."""
    import serving.kernels.cpu
    from serving.kernels.cpu import isa

    base = {"cpu_model": "AMD EPYC 7B13", "cpu_flags": ["avx2", "fma", "f16c"], "isa": "avx2", "machine": "x86_64"}

    def set_machine(flags=None, sources="aaaa", **changes) -> None:
        info = {**base, **changes, **({"cpu_flags": flags} if flags is not None else {})}
        monkeypatch.setattr(isa, "describe", lambda: dict(info))
        monkeypatch.setattr(serving.kernels.cpu, "sources_hash", lambda: sources)

    return set_machine


def _keys() -> tuple[str, str]:
    from flows import speed_rounds as speed
    from flows.data import MeasureConfig
    from flows.release_tasks import _measure_key

    variant = Variant("int4wo", "int4wo", "/v", "c0ffee")
    baseline = Variant("baseline", None, "/b", "beef")
    return (_measure_key(None, {"variant": variant, "config": MeasureConfig()}),
            speed.cache_key([baseline, variant], SpeedPlan()))


def test_a_change_of_cpu_flags_or_kernel_sources_misses_the_measure_cache(machine_of, monkeypatch):
    import torch

    machine_of()
    first = _keys()
    assert _keys() == first  # the same machine: a hit
    machine_of(flags=["avx2", "fma", "f16c", "avx512f"])
    assert all(a != b for a, b in zip(_keys(), first, strict=True))
    machine_of(sources="bbbb")
    assert all(a != b for a, b in zip(_keys(), first, strict=True))
    machine_of(isa="scalar")
    assert all(a != b for a, b in zip(_keys(), first, strict=True))
    machine_of(cpu_model="Intel Xeon Platinum 8481C")
    assert all(a != b for a, b in zip(_keys(), first, strict=True))
    machine_of()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert all(a != b for a, b in zip(_keys(), first, strict=True))


def test_the_machine_line_names_cpu_flags_kernel_path_and_threads(machine_of):
    from flows import machine

    machine_of()
    info = machine.describe()
    line = machine.line(info)
    assert "AMD EPYC 7B13" in line and "avx2 fma f16c" in line and "kernel path avx2" in line
    assert f"{info['threads']} threads" in line and "on cpu" in line and "kernel sources aaaa" in line


# ---- recorded in MLflow, shown in the report ------------------------------------------------------------



def test_speed_verdicts_are_recorded_with_their_ci_and_the_machine(store, tmp_path):
    from gates_fixtures import make_release

    from gates.judging.gate_report import render_markdown
    from gates.records.evaluation import evaluate_run, read_evaluation
    from gates.records.tracking import get_client

    timer, _ = crafted({"baseline": 20.0, "int4wo": 30.0}, wobble={"int4wo": [0.6, 0.8, 0.62, 0.9, 1.0]})
    speeds = speed_metrics(paired_rounds(["baseline", "int4wo"], POINTS, timer, rounds=5))
    run_id, _ = make_release("m-speed", {"int4wo": speeds["int4wo"]}, baseline=speeds["baseline"])["int4wo"]
    get_client().set_tag(run_id, M.MACHINE_TAG, "AMD EPYC 7B13 (x86_64; avx2 fma f16c), kernel path avx2, 2 threads")
    policy = tmp_path / "policy.yaml"
    policy.write_text("tasks: {max_drop: 0.05}\nserving: {min_decode_speedup: 1.0, min_prefill_speedup: 0.8}\n")
    evaluation = evaluate_run(run_id, str(policy))
    verdicts = {r.name: r.verdict for r in evaluation.results if r.name.startswith("serve/")}
    # per-round ratios 0.9x-1.5x: the CI straddles 1.0 (decode) and clears 0.8 (prefill)
    assert verdicts == {"serve/min_decode_speedup/b1": UNINFORMATIVE, "serve/min_decode_speedup/b4": UNINFORMATIVE,
                        "serve/min_decode_speedup/b16": UNINFORMATIVE, "serve/min_prefill_speedup": PASS}
    assert not evaluation.passed
    tags = get_client().get_run(run_id).data.tags
    assert tags["gate/serve/min_decode_speedup/b4/verdict"] == UNINFORMATIVE
    assert tags["gate/serve/min_decode_speedup/b4/blocks"] == "true"
    back = read_evaluation(run_id)
    assert back.extra["machine"].startswith("AMD EPYC 7B13")
    report = render_markdown(back, "int4wo")
    assert "measured on: AMD EPYC 7B13 (x86_64; avx2 fma f16c), kernel path avx2, 2 threads" in report
    assert "decode speedup at batch 16" in report and "95% CI" in report and "5 paired rounds" in report


def test_the_policy_names_the_operating_points_and_what_an_uninformative_speed_does():
    from gates.judging.policy import PolicyError, load_policy

    default = load_policy()
    assert (default.decode_batches, default.min_prefill_speedup, default.canary_min_tpot_speedup) == ((1, 4, 16), 0.8, 0.8)
    assert default.uninformative_blocks("serving")
    assert parse_policy({"tasks": {"max_drop": 0.1}}).uninformative_serving == "block"  # absent: blocks
    for bad, message in (({"decode_batches": [0]}, "serving.decode_batches"),
                         ({"decode_batches": [1, 1]}, "decode batch sizes repeat"),
                         ({"min_prefill_speedup": 0}, "expected a number > 0")):
        with pytest.raises(PolicyError, match=message):
            parse_policy({"tasks": {"max_drop": 0.1}, "serving": bad})
    with pytest.raises(PolicyError, match="sensitivity.serving"):
        parse_policy({"tasks": {"max_drop": 0.1}, "sensitivity": {"serving": "ignore"}})


# ---- operating points and group-sequential rounds (issue 48 items 1 and 2) ---------------------------


def test_the_plan_names_the_policys_served_points_and_the_engines_kv_blocks_fit_them():
    from flows.speed_rounds import BLOCK_SIZE, kv_blocks

    policy = parse_policy({**POLICY, "speed": {"prefill_tokens": 256, "decode_context": 128, "decode_steps": 64,
                                               "long_context": {"context": 1024, "steps": 16},
                                               "look_every": 4, "max_rounds": 12, "time_budget_s": 90}})
    plan = SpeedPlan.from_policy(policy, "cpu")
    assert (plan.prefill_tokens, plan.decode_context, plan.decode_tokens, plan.rounds, plan.look_every) == \
        (256, 128, 64, 12, 4)
    assert plan.time_budget_s == 90 and plan.min_decode == 1.0 and plan.min_prefill == 0.8
    assert plan.points() == ["prefill", "decode_b1", "decode_b4", "decode_b16"]
    assert plan.points(kv=True)[-1] == "long_decode_b1"
    assert plan.shape("decode_b16") == {"prompt_tokens": 128, "steps": 64, "batch": 16}
    assert plan.shape("long_decode_b1") == {"prompt_tokens": 1024, "steps": 16, "batch": 1}
    # every sequence of the largest point fits the blocks: batch 16 x (128 + 64 + 1 + the sampled token)
    assert kv_blocks(plan) * BLOCK_SIZE >= 16 * (128 + 64 + 2)
    default = SpeedPlan.from_policy(parse_policy(POLICY), "cpu")  # the defaults users serve
    assert (default.prefill_tokens, default.decode_context, default.decode_tokens, default.long_context) == \
        (512, 384, 64, 2048)


def _sequential(true: dict[str, float], sd: float, design, seed: int = 0, **kw):
    """The real loop on crafted log-normal round ratios: baseline 100 tok/s, each variant true x e^N(0, sd)."""
    import random

    from flows.speed_rounds import sequential_rounds

    rng, calls = random.Random(seed), []

    def timer(name: str, point: str, round_: int) -> float:
        calls.append((name, point, round_))
        return 100.0 if name == "baseline" else 100.0 * true[name] * math.exp(rng.gauss(0.0, sd))

    speeds, looks = sequential_rounds(["baseline", *true], {"decode_b1": list(true)}, timer, design,
                                      {"decode_b1": 1.0}, warmup=0, **kw)
    return speeds, looks, calls


def test_a_clear_point_stops_at_the_first_look_and_is_no_longer_timed():
    from flows.speed_rounds import sequential_metrics
    from gates.judging.speed_verdicts import SequentialDesign

    design = SequentialDesign(look_every=5, max_rounds=20)
    speeds, looks, calls = _sequential({"fast": 1.5, "same": 1.0}, 0.05, design)
    assert looks[("fast", "decode_b1")].decision == PASS and looks[("fast", "decode_b1")].ci.n == 5
    assert not [c for c in calls if c[0] == "fast" and c[2] >= 5]  # stopped: never timed again
    assert len(speeds["baseline"]["decode_b1"]) == 20  # the baseline runs on beside the open point
    same = looks[("same", "decode_b1")]
    assert same.decision == UNINFORMATIVE and same.ci.n == 20 and same.ci.low < 1.0 < same.ci.high
    metrics = sequential_metrics(speeds, looks, SpeedPlan())["fast"]
    assert metrics[M.speed_point("decode_b1", "rounds")] == 5 and metrics[M.speed_point("decode_b1", "batch")] == 1
    assert metrics[M.speed_point("decode_b1", "prompt_tokens")] == 384
    assert 0.98 < metrics[M.speed_point("decode_b1", "ci_level")] < 0.99  # Pocock-type: ~0.982 a look
    gate = _release_gates(metrics)["serve/min_decode_speedup/b1"]
    assert gate.verdict == PASS and "98.2% look-adjusted CI" in gate.reason and "5 paired rounds" in gate.reason


def test_the_time_budget_ends_the_rounds_with_a_final_look_that_spends_the_alpha_left():
    from gates.judging.speed_verdicts import SequentialDesign

    ticks = iter(range(10_000))  # a clock: each call one second later; a round costs two ticks
    speeds, looks, _ = _sequential({"same": 1.0}, 0.05, SequentialDesign(5, 20), budget_s=13.0,
                                   clock=lambda: float(next(ticks)))
    look = looks[("same", "decode_b1")]
    assert look.ci.n == len(speeds["same"]["decode_b1"]) < 20 and look.decision == UNINFORMATIVE
    assert look.level < 0.98  # the last look spends what the looks before it left


def test_the_time_budget_never_ends_the_rounds_before_the_first_look():
    """A budget a slow machine spends in one round still leaves every point a CI (of the first look)."""
    from gates.judging.speed_verdicts import SequentialDesign

    ticks = iter(range(10_000))
    speeds, looks, _ = _sequential({"same": 1.0}, 0.05, SequentialDesign(5, 20), budget_s=0.5,
                                   clock=lambda: float(next(ticks)))
    assert len(speeds["same"]["decode_b1"]) == 5 and looks[("same", "decode_b1")].ci.n == 5


def test_simulated_coverage_and_error_rates_of_the_sequential_rounds():
    """Thousands of crafted draws through the real loop: the stopped, look-adjusted CI covers the true ratio
    at least at the nominal 95 % (within 0.02 at the minimum, where every look counts), and no point passes
    when its true ratio is below the minimum (or fails above it) more often than alpha."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from speed_sequential import simulate

    from gates.judging.speed_verdicts import SequentialDesign

    rows = simulate((0.9, 0.97, 1.0, 1.03, 1.1), draws=1500, sd=0.08, design=SequentialDesign(5, 20), seed=1)
    for true, row in rows.items():
        assert 0.93 <= row["cover"] <= 0.995, (true, row)
    assert abs(rows[1.0]["cover"] - 0.95) <= 0.02
    assert rows[0.9][PASS] + rows[0.97][PASS] + rows[1.0][PASS] <= 0.05 * 3
    assert max(rows[t][PASS] for t in (0.9, 0.97, 1.0)) <= 0.05
    assert max(rows[t][FAIL] for t in (1.0, 1.03, 1.1)) <= 0.05
    assert rows[0.9][FAIL] > 0.95 and rows[1.1][PASS] > 0.95 and rows[1.1]["rounds"] < 15  # decided, early


def test_the_long_context_point_is_capped_at_the_models_context(tmp_path):
    import json

    from flows.speed_rounds import capped

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    plan = SpeedPlan(long_context=2048, long_tokens=32)
    assert capped(plan, str(tmp_path)).long_context == 1024 - 32 - 2
    assert capped(SpeedPlan(long_context=512), str(tmp_path)).long_context == 512
