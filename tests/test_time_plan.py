"""The release's time per stage (gates/time_plan.py) adds up the pilot's measured costs as the stages spend
them: crafted costs, exact seconds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gates import time_plan as T
from gates.judging.policy import load_policy
from gates.pilot import Timing
from gates.release_plan import items_at

DEMO_POLICY = Path(__file__).resolve().parents[1] / "flows" / "demo_policy.yaml"


def test_a_measure_stage_is_its_load_serving_evals_and_prompt_tokens() -> None:
    shape = T.MeasureShape(items={"arc_easy": 40, "piqa": 40, "perplexity": 10}, bench_requests=16,
                           bench_concurrency=4, bench_max_tokens=32, fidelity_tokens=1024, probe_tokens=4000,
                           probe_models=("baseline",))
    base = T.measure_seconds("baseline", shape, {"arc_easy": 0.5, "piqa": 0.25}, 2.0, 1000.0, 3.2)  # s a wave
    assert base.seconds == pytest.approx(2.0 + 4 * 3.2 + 40 * 0.5 + 40 * 0.25 + (1024 + 4000) / 1000.0)
    assert "not timed: perplexity" in base.counted
    variant = T.measure_seconds("int8wo", shape, {"arc_easy": 0.5, "piqa": 0.25}, 2.0, 1000.0, 3.2)
    assert variant.seconds == pytest.approx(base.seconds - 4.0)  # the probes run on the baseline only


def test_decode_steps_come_from_the_nearest_measured_batch() -> None:
    decode = {1: 6.5, 4: 13.0, 16: 32.5}
    assert T.step_seconds(decode, 64, 4) == pytest.approx(0.2)
    assert T.step_seconds(decode, 64, 3) == pytest.approx(0.2)
    assert T.step_seconds(decode, 64, 12) == pytest.approx(0.5)
    assert T.step_seconds({}, 64, 4) is None


def test_the_speed_stage_stops_at_its_budget_or_max_rounds() -> None:
    policy = load_policy(DEMO_POLICY)  # 12 rounds at most, a look every 4, 90 s of timed rounds
    sp = policy.speed
    assert (sp.max_rounds, sp.look_every, sp.time_budget_s) == (12, 4, 90)
    fast = T.speed_seconds(policy, 2, round_s=2.0, load_s=3.0)  # 12 rounds of a pair: 48 s, under 60
    assert fast.seconds == pytest.approx(3.0 + 2 * (3.0 + 4.0 + 48.0))
    slow = T.speed_seconds(policy, 2, round_s=3.0, load_s=3.0)  # the budget: 90 x 2/3 s, 10 whole rounds of 6 s
    assert slow.seconds == pytest.approx(3.0 + 2 * (3.0 + 6.0 + 60.0))
    crawl = T.speed_seconds(policy, 2, round_s=20.0, load_s=3.0)  # the first look always runs: 4 rounds
    assert crawl.seconds == pytest.approx(3.0 + 2 * (3.0 + 40.0 + 160.0))
    assert [sp.pair_rounds(2, r) for r in (4.0, 6.0, 40.0)] == [12, 10, 4]  # the rounds each figure counts


def test_the_flow_and_the_plan_split_the_budget_alike() -> None:
    from flows.data import SpeedPlan
    from flows.speed_rounds import pair_budget

    policy = load_policy(DEMO_POLICY)
    for variants in (1, 2, 5):
        assert pair_budget(SpeedPlan.from_policy(policy), variants) == pytest.approx(90 * 2 / (variants + 1))


def test_stage_times_from_a_pilot_and_without_one() -> None:
    policy = load_policy(DEMO_POLICY)
    shape = T.MeasureShape(items={"arc_easy": 40})
    timing = Timing(item_s={"arc_easy": 0.5}, round_s=2.0, prefill_tps=1000.0, load_s=2.0,
                    decode_s={1: 6.5, 4: 13.0, 16: 32.5})
    rows = T.stage_times(policy, T.ReleaseShape(["baseline", "int8wo"], shape), timing)
    assert [r.stage for r in rows] == ["measure baseline", "measure int8wo", "speed"]
    assert rows[0].seconds == pytest.approx(2.0 + 4 * 32 * 0.2 + 20.0)
    timing.setup_s = {"arc_easy": 3.0}  # a task's cost per run: once per measure stage, whatever its items
    alone = T.ReleaseShape(["baseline"], shape)
    assert T.stage_times(policy, alone, timing)[0].seconds == pytest.approx(2.0 + 25.6 + 20.0 + 3.0)
    assert all(r.seconds is None for r in T.stage_times(policy, alone, Timing()))
    timing.first_load_s = 3.0  # a fresh process's first load: the first stage pays it, once
    first, second = T.stage_times(policy, T.ReleaseShape(["baseline", "int8wo"], shape), timing)[:2]
    assert first.seconds == pytest.approx(2.0 + 25.6 + 20.0 + 3.0 + 3.0) and "first calls" in first.counted
    assert second.seconds == pytest.approx(2.0 + 25.6 + 20.0 + 3.0)
    timing.first_load_s = 0.2  # noise between two warm loads: not a cost worth a line
    assert "first calls" not in T.stage_times(policy, T.ReleaseShape(["baseline"], shape), timing)[0].counted
    assert "**" in T.markdown(rows, 40) and "--limit 40" in T.markdown(rows, 40)


def test_quantizing_and_the_canary_are_costed_in_the_flow_s_order() -> None:
    from quantize.pilot import QuantizeTiming

    policy = load_policy(DEMO_POLICY)
    timing = Timing(item_s={"arc_easy": 0.5}, round_s=2.0, prefill_tps=1000.0, load_s=2.0,
                    decode_s={1: 6.5, 4: 13.0, 16: 32.5},
                    quantize={"int8wo": QuantizeTiming("int8wo", layers=24, fixed_s=2.0, per_layer_s=0.25, start_s=5.0)})
    release = T.ReleaseShape(["baseline", "int8wo", "int4-awq"], T.MeasureShape(items={"arc_easy": 40}), limit=40,
                             quantize=(("int8wo", "int8wo", {}), ("int4-awq", "int4-awq", {})),
                             canary=T.CanaryShape(requests=24, concurrency=4, max_tokens=16))
    rows = T.stage_times(policy, release, timing)
    assert [r.stage for r in rows] == ["quantize int8wo", "quantize int4-awq", "measure baseline", "measure int8wo",
                                       "measure int4-awq", "speed", "canary"]
    assert rows[0].seconds == pytest.approx(5.0 + 2.0 + 24 * 0.25)
    timing.source_hash_s = 3.0  # the flow hashes the source as it resolves it, before any stage
    hashed = T.stage_times(policy, release, timing)
    assert (hashed[0].stage, hashed[0].seconds) == ("resolve", 3.0) and hashed[1:] == rows
    timing.snapshot_s = 2.5  # a first release copies a source outside the home, after resolving it
    first = T.stage_times(policy, replace(release, snapshot=True), timing)
    assert [(r.stage, r.seconds) for r in first[:2]] == [("resolve", 3.0), ("snapshot", 2.5)] and first[2:] == rows
    timing.source_hash_s = 0.0
    assert rows[1].seconds is None  # not piloted: said, never guessed
    assert rows[-1].seconds == pytest.approx(2 * 2.0 + 6 * 16 * 0.2)  # both loaded; 6 waves of 16 steps at b4
    text = T.markdown(rows, 40)
    assert "not costed: quantize int4-awq" in text and "the canary 0.4 min more" in text
    timing.canary_up_s, timing.canary_request_s = 0.5, 0.3  # the pilot replayed some through a server and router
    piloted = T.stage_times(policy, release, timing)[-1]
    assert piloted.seconds == pytest.approx(2 * 2.0 + 0.5 + 24 * 0.3) and "24 requests x 0.30 s" in piloted.counted


def test_items_per_task_at_a_limit() -> None:
    assert items_at(["arc_easy", "cloze"], 40) == {"arc_easy": 40, "cloze": 40}
    assert items_at(["cloze"], 1000) == {"cloze": 158}  # its whole data where it has fewer


def test_a_variant_is_costed_from_its_cuts_beside_the_baseline_s() -> None:
    """The baseline and the variant cut to 1 and 6 layers: each pair's line through the two depths, at the
    model's 24 layers, says what the whole variant saves; that comes off the whole baseline's load and step."""
    from gates.pilot import CutServed

    policy = load_policy(DEMO_POLICY)
    # baseline load 1.0 + 0.2 a layer, the variant 1.5 + 0.1 a layer: at 24 layers it saves 2.4 - 0.5 = 1.9 s;
    # steps 4 ms + 1 ms a layer against 4 ms + 0.5 ms: 12 ms saved at 24 layers
    cut = CutServed(layers=(1, 6), model_layers=24, load_s=((1.2, 1.6), (2.2, 2.1)),
                    step_s=((0.005, 0.0045), (0.010, 0.007)))
    assert cut.saved("load_s") == pytest.approx(1.9) and cut.saved("step_s") == pytest.approx(0.012)
    assert T.less_saved(5.0, 1.9) == pytest.approx(3.1) and T.less_saved(1.0, 1.9) == pytest.approx(0.1)
    timing = Timing(item_s={"arc_easy": 0.5}, round_s=2.0, prefill_tps=1000.0, load_s=5.0,
                    decode_s={1: 6.5, 4: 13.0, 16: 32.5}, variants={"int8wo": cut})
    release = T.ReleaseShape(["baseline", "int8wo", "int4-awq"], T.MeasureShape(items={"arc_easy": 40}),
                             weights={"int8wo": "int8wo", "int4-awq": "int4-awq"})
    base, int8, int4 = T.stage_times(policy, release, timing)[:3]
    assert int4.seconds == base.seconds  # no cuts served: the baseline's figures
    assert base.seconds - int8.seconds == pytest.approx(1.9 + 4 * 32 * 0.012)  # load; 4 waves x 32 steps
    assert "from its cuts at 1 and 6 layers" in int8.counted and "cuts" not in base.counted
    timing.serving_wave_s = 9.0  # a wave through the server as the pilot timed it, not the engine's steps
    base, int8 = T.stage_times(policy, release, timing)[:2]
    assert base.seconds == pytest.approx(5.0 + 4 * 9.0 + 20.0)
    assert base.seconds - int8.seconds == pytest.approx(1.9 + 4 * 32 * 0.012)
    timing.first_wave_s = 6.0  # the process's first server: the first measure stage pays it, once
    first, second = T.stage_times(policy, release, timing)[:2]
    assert first.seconds == pytest.approx(base.seconds + 6.0) and "first server" in first.counted
    assert second.seconds == pytest.approx(int8.seconds)


def test_a_suite_run_pays_its_setup_once() -> None:
    """The tasks of one suite run together, sharing the run's setup (the largest of theirs); a task of no
    suite run pays its own."""
    from gates.release_plan import suite_runs

    items = {"harmbench": 20, "advbench": 20, "over_refusal": 20, "arc_easy": 20}
    setup = {"harmbench": 2.2, "advbench": 2.3, "over_refusal": 1.9, "arc_easy": 0.4}
    item_s = dict.fromkeys(items, 0.1)
    apart = T.measure_seconds("baseline", T.MeasureShape(items=items), item_s, 0.0, 1e9, None, setup)
    runs = suite_runs(["safety", "arc_easy"])
    assert runs == (("harmbench", "advbench", "over_refusal"), ("arc_easy",))
    together = T.measure_seconds("baseline", T.MeasureShape(items=items, runs=runs), item_s, 0.0, 1e9, None, setup)
    assert apart.seconds == pytest.approx(8.0 + 2.2 + 2.3 + 1.9 + 0.4)
    assert together.seconds == pytest.approx(8.0 + 2.3 + 0.4)
