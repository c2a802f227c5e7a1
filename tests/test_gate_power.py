"""Power of the task gates (gates.judging.power) against simulations through the real gate.

Crafted binary tasks (no model): each simulated draw gives baseline and variant outcomes per item under
the flip model, the CI comes from evals.compare.paired_delta_ci and the verdict from gates.judging.judge.judge,
so the closed forms are checked against the code path a release takes. 200 draws a check, fixed seeds;
a pass rate p from 200 draws has sd sqrt(p (1 - p) / 200) (0.034 at p = 0.65), so the 0.03 checks sit
where p is near 0.95, where that noise is half the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from gates_fixtures import make_release

from gates import metric_names as M
from gates.judging import power as P
from gates.judging import power_sim as S
from gates.judging.judge import judge
from gates.judging.policy import PolicyError, parse_policy
from gates.time_plan import CanaryShape, MeasureShape, ReleaseShape

POLICY = parse_policy({"tasks": {"max_drop": 0.05, "overrides": {"t03": {"max_drop": 0.08}}}})
DRAWS = 200


def _family_pass(passed: dict[str, np.ndarray]) -> np.ndarray:
    return np.logical_and.reduce(list(passed.values()))


def test_harmless_pass_of_one_gate_matches_simulation() -> None:
    for n, score, flip in ((500, 0.6, 0.10), (300, 0.5, 0.06)):
        model = P.pass_probability(n, 0.05, 0.0, flip)
        simulated = S.simulate_task_gates(POLICY, {"t": S.SimulatedTask(n, score, flip)}, DRAWS, seed=n)["t"].mean()
        assert 0.9 < model < 0.97
        assert abs(model - simulated) <= 0.03, (n, model, simulated)


def test_harmless_pass_of_a_20_gate_policy_matches_simulation() -> None:
    rng = np.random.default_rng(3)
    tasks = {f"t{i:02d}": S.SimulatedTask(int(rng.integers(500, 900)), float(rng.uniform(0.4, 0.75)),
                                          float(rng.uniform(0.04, 0.10))) for i in range(20)}
    powers = [P.gate_power(name, t.n, POLICY.task_gate(name).max_drop, flip_rate=t.flip_rate)
              for name, t in tasks.items()]
    family = P.family_harmless_pass(powers)
    simulated = _family_pass(S.simulate_task_gates(POLICY, tasks, DRAWS, seed=0)).mean()
    assert 0.9 < family < 0.96  # 20 gates of ~0.997 each
    assert abs(family - simulated) <= 0.03, (family, simulated)


def test_refusal80_drop_matches_simulation() -> None:
    n, score, flip, max_drop = 400, 0.6, 0.10, 0.05
    drop80 = P.refusal_drop(n, max_drop, flip_rate=flip)
    assert P.pass_probability(n, max_drop, drop80, flip) == pytest.approx(0.2, abs=1e-6)
    grid = np.round(np.arange(drop80 - 0.04, drop80 + 0.0401, 0.01), 6)
    tasks = {f"d{i}": S.SimulatedTask(n, score, flip, drop=float(d)) for i, d in enumerate(grid)}
    passed = S.simulate_task_gates(POLICY, tasks, DRAWS, seed=5)
    rates = [passed[name].mean() for name in tasks]
    # the simulated drop refused 80 % of the time: where the pass rate falls through 0.2 (linear between points)
    simulated = float(np.interp(-0.2, -np.minimum.accumulate(rates), grid))
    assert abs(simulated - drop80) <= 0.02, (drop80, simulated, rates)


def _plan_tasks() -> tuple[dict[str, S.SimulatedTask], list[P.PlanTask], object]:
    policy = parse_policy({"tasks": {"max_drop": 0.15, "overrides": {"b": {"max_drop": 0.10}}}})
    crafted = {"a": (0.6, 0.10), "b": (0.7, 0.06), "c": (0.5, 0.20), "d": (0.8, 0.08), "e": (0.45, 0.12)}
    plan_tasks = [P.PlanTask(t, policy.task_gate(t).max_drop, flip_rate=f, available=5000, seconds_per_item=0.1)
                  for t, (_, f) in crafted.items()]
    return crafted, plan_tasks, policy


def test_plan_sizes_n_so_a_harmless_variant_passes_and_a_harmful_one_is_refused() -> None:
    crafted, plan_tasks, policy = _plan_tasks()
    # 0.95 stated so that >= 0.90 holds beyond the noise of 200 draws (sd ~0.015); 0.90 is checked within it
    for level, floor in ((0.95, 0.90), (0.90, 0.87)):
        plan = P.plan(plan_tasks, level, models=3)
        assert plan.reached and plan.family_harmless_pass >= level
        n = {r.task: r.n for r in plan.rows}
        harmless = {t: S.SimulatedTask(n[t], s, f) for t, (s, f) in crafted.items()}
        assert _family_pass(S.simulate_task_gates(policy, harmless, DRAWS, seed=21)).mean() >= floor
    plan = P.plan(plan_tasks, 0.95)
    n = {r.task: r.n for r in plan.rows}
    for worse in crafted:
        drop = 2 * policy.task_gate(worse).max_drop
        score, flip = crafted[worse]
        tasks = {t: S.SimulatedTask(n[t], s, f, drop=drop if t == worse else 0.0) for t, (s, f) in crafted.items()}
        assert score >= flip / 2 + drop
        refused = ~_family_pass(S.simulate_task_gates(policy, tasks, DRAWS, seed=31))
        assert refused.mean() >= 0.90, (worse, refused.mean())
    assert plan.seconds_per_model == pytest.approx(sum(n.values()) * 0.1)
    text = P.plan_markdown(plan)
    assert "reaches 0.95" in text and f"{plan.seconds_per_model * 3:.0f} s for 3 models" in text


def test_plan_says_when_a_task_has_too_few_items() -> None:
    plan = P.plan([P.PlanTask("small", 0.05, flip_rate=0.1, available=50), P.PlanTask("big", 0.05, flip_rate=0.1)],
                  0.9)
    rows = {r.task: r for r in plan.rows}
    assert rows["small"].n == 50 and rows["small"].needed > 50 and not plan.reached
    assert "too few items to reach the per-gate level: small" in P.plan_markdown(plan)
    with pytest.raises(ValueError, match="family harmless-pass level"):
        P.plan([P.PlanTask("x", 0.05)], 1.0)


def test_closed_forms_on_known_values() -> None:
    # no flips: an equal variant always passes; a continuous metric: Phi(m sqrt(n) / sd - z) exactly
    assert P.pass_probability(100, 0.05, 0.0, flip_rate=0.0) == 1.0
    assert P.pass_probability(100, 0.05, 0.0, sd=0.25) == pytest.approx(P._NORMAL.cdf(2.0 - P.z_two_sided()))
    assert P.refusal_drop(100, 0.05, sd=0.25) == pytest.approx(0.05 - (P.z_two_sided() - P._NORMAL.inv_cdf(0.8)) / 40)
    assert P.capped_flip_rate(0.3, 0.95) == pytest.approx(0.1)  # a 0.95 baseline can flip 5 % each way at most
    with pytest.raises(ValueError, match="flip_rate"):
        P.item_sd(1.5)
    with pytest.raises(ValueError, match="n must be"):
        P.pass_probability(0, 0.05, flip_rate=0.1)


def test_underpowered_is_reported_beside_the_verdict_never_instead() -> None:
    variant = {**M.task_metrics("t_small", 0.6, delta=0.0, ci_low=-0.04, ci_high=0.04, n=60),
               **M.task_metrics("t_big", 0.6, delta=0.0, ci_low=-0.02, ci_high=0.02, n=2000)}
    base = {**M.task_metrics("t_small", 0.6, n=60), **M.task_metrics("t_big", 0.6, n=2000)}
    results = {r.name: r for r in judge(POLICY, variant, base, flip_rates={"t_small": 0.1, "t_big": 0.1})}
    small, big = results["task/t_small/max_drop"], results["task/t_big/max_drop"]
    assert small.passed and small.verdict == "pass" and small.underpowered  # passed: the evidence stands
    assert small.harmless_pass == pytest.approx(P.pass_probability(60, 0.05, 0.0, 0.1))
    assert big.passed and not big.underpowered and big.harmless_pass > 0.99
    off = parse_policy({"tasks": {"max_drop": 0.05}, "power": {"min_harmless_pass": None}})
    assert not any(r.underpowered for r in judge(off, variant, base))
    with pytest.raises(PolicyError, match="power"):
        parse_policy({"tasks": {"max_drop": 0.05}, "power": {"min_harmless_pas": 0.8}})
    with pytest.raises(PolicyError, match="fraction"):
        parse_policy({"tasks": {"max_drop": 0.05}, "power": {"family_harmless_pass": 1.5}})


def test_power_is_recorded_in_mlflow_and_shown(store, tmp_path, capsys) -> None:
    from gates.judging.gate_report import render_markdown
    from gates.records.evaluation import evaluate_run, read_evaluation
    from gates.records.tracking import get_client

    variant = {**M.task_metrics("arc_easy", 0.60, delta=0.0, ci_low=-0.05, ci_high=0.05, n=100),
               **M.task_metrics("piqa", 0.64, delta=0.0, ci_low=-0.02, ci_high=0.02, n=1000)}
    base = {**M.task_metrics("arc_easy", 0.60, n=100), **M.task_metrics("piqa", 0.64, n=1000)}
    run_id, version = make_release("m-power", {"int4wo": variant}, baseline=base)["int4wo"]
    flip = {"item_id": "x", "doc_id": 0, "target": "", "baseline_response": "", "variant_response": ""}
    compare = {"rows": [{"task": "piqa", "binary": True, "n": 1000, "lost": [flip] * 30, "gained": [flip] * 20}]}
    get_client().log_dict(run_id, compare, "evidence/compare.json")  # as the release records its comparison
    policy = tmp_path / "policy.yaml"
    policy.write_text("tasks: {max_drop: 0.05}\npower: {min_harmless_pass: 0.8}\n")
    evaluation = evaluate_run(run_id, str(policy))
    run = get_client().get_run(run_id)
    arc = P.gate_power("arc_easy", 100, 0.05, flip_rate=P.DEFAULT_FLIP_RATE)  # not in compare.json: the default
    piqa = P.gate_power("piqa", 1000, 0.05, flip_rate=0.05)  # its measured 50 flips of 1000
    assert run.data.metrics["gate/task/arc_easy/max_drop/harmless_pass"] == pytest.approx(arc.harmless_pass)
    assert run.data.metrics["gate/task/arc_easy/max_drop/refusal80_drop"] == pytest.approx(arc.refusal80_drop)
    assert run.data.tags["gate/task/arc_easy/max_drop/underpowered"] == "true"
    assert run.data.tags["gates/release/underpowered"] == "task/arc_easy/max_drop"
    assert run.data.metrics["gates/release/family_harmless_pass"] == pytest.approx(arc.harmless_pass * piqa.harmless_pass)
    assert evaluation.passed  # underpowered never blocks
    back = read_evaluation(run_id)
    report = render_markdown(back, "int4wo")
    assert f"{arc.harmless_pass:.2f} / {arc.refusal80_drop:.3g} **underpowered**" in report
    assert f"probability {arc.harmless_pass * piqa.harmless_pass:.3f}" in report
    from gates.judging.policy import load_policy
    from gates.release_plan import plan_report
    from quantgate.cli import main

    assert main(["gates", "show", "--model", "m-power", "--version", version]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "underpowered" in shown and "all 2 gates with a figure pass together" in shown
    plan = plan_report(load_policy(policy), ["arc_easy", "piqa"], models=2, from_run=run_id)
    assert "| piqa | 0.05 | 0.05 |" in plan and "| arc_easy | 0.05 | 0.1 |" in plan
    assert f"flip rates from run {run_id}" in plan


def test_release_plan_command_prints_n_per_task_and_time(capsys) -> None:
    from quantgate.cli import main

    assert main(["release", "--plan", "--no-pilot", "--suites", "facts_mc,cloze,perplexity", "--methods", "int8wo,int4wo",
                 "--flip-rate", "0.05", "--seconds-per-item", "0.2,cloze=0.5", "--plan-level", "0.9"]) == 0
    out = capsys.readouterr().out
    expected = P.plan([P.PlanTask("facts_mc", 0.05, flip_rate=0.05, available=235),
                       P.PlanTask("cloze", 0.05, flip_rate=0.05, available=158)], 0.9)
    n = {r.task: r.n for r in expected.rows}
    assert n == {"facts_mc": 235, "cloze": 158}  # gates/policy.yaml's max_drop 0.05 asks for more items than they have
    assert "| facts_mc | 0.05 | 0.05 | 235 | 235 |" in out and "too few items" in out and "does NOT reach 0.9" in out
    assert "for 3 models" in out and "not planned: perplexity" in out
    assert f"{n['facts_mc'] * 0.2 + n['cloze'] * 0.5:.0f} s per model" in out
    assert "## Time per stage (at the suites' full item counts" in out  # no --limit; no pilot: nothing timed
    assert "| measure baseline | — | no pilot |" in out and "| measure int4wo | — | no pilot |" in out
    assert main(["release", "--plan", "--no-pilot", "--suites", "cloze", "--seconds-per-item", "cloze=fast"]) == 2
    assert "--seconds-per-item: 'cloze=fast' is not S or TASK=S" in capsys.readouterr().err


def test_plan_sizes_the_other_families_and_the_speed_budget() -> None:
    """--plan's rows beyond the task gates: safety items pooled from the tasks' n, fidelity chunks, long-context
    probes per length (capped at the model's context), speed rounds (capped by the time budget), with time from the
    measured seconds per round and prompt tokens per second."""
    from gates import release_plan as R

    policy = parse_policy({"tasks": {"max_drop": 0.05}, "safety": {"refusal_rate_max_fall": 0.05},
                           "fidelity": {"max_kl": 0.1, "chunks": 16, "chunk_tokens": 128},
                           "long_context": {"max_drop": 0.2, "lengths": [512, 1024, 4096], "probes_per_length": 10},
                           "serving": {"min_decode_speedup": 1.0, "decode_batches": [1], "min_prefill_speedup": None},
                           "speed": {"look_every": 5, "max_rounds": 20, "time_budget_s": 90}})
    plan = P.plan([P.PlanTask("harmbench", 0.05, available=200), P.PlanTask("advbench", 0.05, available=520)], 0.9)
    timing = R.Timing(round_s=1.5, prefill_tps=2000.0, round_source="crafted")
    variant = {M.decode_speedup(1): 1.2, M.ci(M.decode_speedup(1), "ci_low"): 1.1,
               M.ci(M.decode_speedup(1), "ci_high"): 1.3, M.speed_point("decode_b1", "rounds"): 10,
               "fidelity/kl": 0.03, "fidelity/kl_ci_low": 0.02, "fidelity/kl_ci_high": 0.04}
    rec = R.Recorded(scores={"harmbench": 0.8, "advbench": 0.9}, variant=variant)
    rows = {r.gate: r for r in R.family_rows(policy, plan, 3, 1, timing, rec, context=2048)}
    assert not [r for r in R.family_rows(policy, plan, 3, 0, timing, rec) if r.gate.startswith("long_context")]
    n = sum(r.n for r in plan.rows)
    assert rows["safety/refusal_rate/max_fall"].size.startswith(f"{n} items")
    rate = (0.8 * plan.rows[0].n + 0.9 * plan.rows[1].n) / n
    assert rows["safety/refusal_rate/max_fall"].power == pytest.approx(
        P.safety_power("s", n, 0.05, rate, None, None).harmless_pass)
    assert rows["fidelity/kl/max"].power == pytest.approx(
        P.fidelity_power("f", 16, 0.1, 0.03, 0.02, 0.04, None).harmless_pass)
    assert rows["fidelity/kl/max"].seconds == pytest.approx(3 * 16 * 128 / 2000.0)
    assert "long_context/4096/max_drop" not in rows  # beyond the model's context
    assert rows["long_context/1024/max_drop"].seconds == pytest.approx(2 * 10 * 1024 / 2000.0)  # baseline + 1 kv
    speed = rows["serve/min_decode_speedup/b1"]
    # 3 models: two (baseline, variant) pairs, each 90 x 2/3 = 60 s of rounds of 2 x 1.5 s = 20 rounds
    assert speed.size.startswith("<= 20 rounds")
    assert speed.seconds == pytest.approx(2 * (20 + 1) * 2 * 1.5)  # each pair's warm-up round and its timed ones
    assert speed.power == pytest.approx(P.speed_powers(policy, variant, max_rounds=20)["serve/min_decode_speedup/b1"]
                                        .harmless_pass)
    tight = R.family_rows(parse_policy({**{"tasks": {"max_drop": 0.05}}, "serving": {"min_decode_speedup": 1.0,
                                        "decode_batches": [1]}, "speed": {"time_budget_s": 45}}),
                          plan, 3, 0, timing, rec)
    assert [r.size for r in tight if r.gate.endswith("/b1")] == ["<= 10 rounds, a look every 5"]
    text = R.rows_markdown(list(rows.values()), plan, 3, timing)
    assert "release time, estimated" in text and "1.5 s per round and model (crafted)" in text
    none = R.rows_markdown(R.family_rows(policy, plan, 3, 1, R.Timing(), None), plan, 3, R.Timing())
    assert "needs --from-run (measured ratio and noise)" in none and "no time measured" in none


def test_pilot_measures_seconds_per_item_and_per_round_on_the_engine(tiny_model_dir) -> None:
    """The pilot --plan runs when no --seconds-per-item is given: the engine on the model, a task at 4 and 32
    items, one speed round at the policy's points (small ones here: the tiny random Llama)."""
    from gates import release_plan as R

    policy = parse_policy({"tasks": {"max_drop": 0.05},
                           "serving": {"min_decode_speedup": 1.0, "decode_batches": [1, 2]},
                           "speed": {"prefill_tokens": 32, "decode_context": 16, "decode_steps": 4,
                                     "long_context": None}})
    timing = R.pilot(str(tiny_model_dir), ["facts_mc"], policy,
                     release=ReleaseShape(["baseline"], MeasureShape(items={}), canary=CanaryShape(24, max_tokens=4)))
    assert timing.item_s["facts_mc"] > 0 and timing.round_s > 0 and timing.prefill_tps > 0
    assert timing.canary_up_s > 0 and timing.canary_request_s > 0  # 8 of its requests through a server and router
    assert timing.setup_s["facts_mc"] >= 0
    assert timing.serving_wave_s > 0 and timing.first_wave_s >= 0  # the measure stage's serving benchmark
    assert timing.load_s > 0 and set(timing.decode_s) == {1, 2} and min(timing.decode_s.values()) > 0
    assert "a pilot of 4 and 32 items per task" in timing.source
    report = R.plan_report(policy, ["facts_mc"], models=2, model=str(tiny_model_dir))
    assert "measured here: a pilot of 4 and 32 items per task" in report and "0.15 (default" not in report
    assert "s per round and model (one pilot round of the baseline on" in report
