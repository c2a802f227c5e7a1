"""The speed stage pairs the baseline with each variant in turn: two engines resident at most (issue 45),
each pair's rounds and ratios as before, speed.json readable as before."""

from __future__ import annotations

import gc
import json
import weakref

from flows.data import BASELINE, SpeedPlan, Variant
from gates import metric_names as M

PLAN = SpeedPlan(decode_batches=(1, 2), decode_tokens=2, decode_context=8, prefill_tokens=8, long_context=16,
                 long_tokens=2, rounds=3, look_every=3, warmup_rounds=1)


def test_measure_holds_the_baseline_and_one_variant_at_most(tiny_model_dir, tmp_path):
    from flows import speed_rounds

    models = [Variant(BASELINE, None, str(tiny_model_dir), "b"), Variant("v1", "v1", str(tiny_model_dir), "1"),
              Variant("v2+kv8", "v2", str(tiny_model_dir), "2", kv_cache_dtype="int8")]
    live: weakref.WeakSet = weakref.WeakSet()
    loaded: list[tuple[str, int]] = []  # (model, engines alive once it loaded)

    def counting_load(model, plan):
        gc.collect()
        engine = speed_rounds.load_engine(model, plan)
        live.add(engine)
        loaded.append((model.name, len(live)))
        return engine

    result = speed_rounds.measure(models, PLAN, tmp_path, "test machine", load=counting_load)
    assert loaded == [(BASELINE, 1), ("v1", 2), ("v2+kv8", 2)]  # v1 was released before v2 loaded
    gc.collect()
    assert len(live) == 0  # and nothing is left once the stage returns

    record = json.loads((tmp_path / "speed.json").read_text())
    assert set(record["rounds"]) == {BASELINE, "v1", "v2+kv8"}
    assert set(record["pairs"]) == {"v1", "v2+kv8"}
    for name, pair in record["pairs"].items():
        assert set(pair) == {BASELINE, name}
        for point, values in pair[name].items():  # every round of a pair timed both models
            assert len(values) == len(pair[BASELINE][point]) == 3 and values == record["rounds"][name][point]
    # the long-context point runs only in the KV-quantized variant's pair
    assert "long_decode_b1" in record["pairs"]["v2+kv8"][BASELINE]
    assert "long_decode_b1" not in record["pairs"]["v1"][BASELINE]
    # the baseline's rounds: every pair's, in pair order
    assert record["rounds"][BASELINE]["prefill"] == (record["pairs"]["v1"][BASELINE]["prefill"]
                                                      + record["pairs"]["v2+kv8"][BASELINE]["prefill"])
    v1 = result.metrics["v1"]
    for point in ("prefill", "decode_b1", "decode_b2"):  # ratios from the pair's own baseline rounds
        pair = record["pairs"]["v1"]
        ratios = [v / b for v, b in zip(pair["v1"][point], pair[BASELINE][point], strict=True)]
        key = speed_rounds.point_key(point)
        assert v1[f"{key}_ci_low"] <= v1[key] <= v1[f"{key}_ci_high"]
        assert min(ratios) <= v1[key] <= max(ratios)
    assert M.long_decode_speedup(1) in result.metrics["v2+kv8"] and M.long_decode_speedup(1) not in v1
    assert v1[M.SERVE_SPEED_ROUNDS] == 3 and M.paired_tps("prefill") in result.metrics[BASELINE]
    assert record["metrics"] == json.loads(json.dumps(result.metrics))
    walls = record["wall_s"]  # the stage's own clock: each load, the warm-ups, each model's timed points
    assert set(walls) == {BASELINE, "v1", "v2+kv8"} and walls[BASELINE]["load"] > 0
    assert set(walls["v1"]) == {"load", "warm-up"} | {f"{m} {p}" for m in (BASELINE, "v1") for p in PLAN.points()}
    assert f"{BASELINE} long_decode_b1" in walls["v2+kv8"] and all(v > 0 for v in walls["v1"].values())
    from gates.evidence import speed_replay  # quantgate verify replays every pair's looks from the file

    for name in ("v1", "v2+kv8"):
        derived, problems = speed_replay.derive(record, name, BASELINE)
        assert problems == []
        for key, value in derived.items():
            assert abs(value - result.metrics[name][key]) <= 1e-9 * abs(value), key


def test_each_pair_gets_its_variants_share_of_the_time_budget():
    from flows.speed_rounds import pair_budget

    assert pair_budget(SpeedPlan(), 2) is None
    assert pair_budget(SpeedPlan(time_budget_s=90.0), 1) == 90.0  # one variant: as before
    assert pair_budget(SpeedPlan(time_budget_s=90.0), 2) == 60.0  # 2 of the 3 timings a round had


def test_the_measure_stage_holds_one_engine_and_leaves_none_behind(tiny_model_dir, tmp_path, monkeypatch):
    """flows/measuring.py measure(): one model's engine for its benchmark, evals and capacity; once the stage
    returns, nothing (server, eval harness) keeps it alive, so the next model loads beside none."""
    from flows import measuring
    from flows.data import MeasureConfig

    live: weakref.WeakSet = weakref.WeakSet()
    real = measuring.load_engine

    def counting_load(variant, config):
        engine = real(variant, config)
        live.add(engine)
        return engine

    monkeypatch.setattr(measuring, "load_engine", counting_load)
    config = MeasureConfig(suites=("facts_mc",), limit=2, bench_requests=2, bench_concurrency=1, bench_max_tokens=2,
                           kv_cache_memory_gb=0.01)
    for name in (BASELINE, "v1"):
        measured = measuring.measure(Variant(name, None, str(tiny_model_dir), name), config, tmp_path / name,
                                     lambda n: None)
        assert measured.metrics[M.WEIGHTS_BYTES] > 0 and "task/facts_mc/n" in measured.metrics
        assert len(live) == 0, f"{name}'s engine is still referenced after its measure stage"
        parts = json.loads((tmp_path / name / "seconds.json").read_text())  # where the stage's time went
        assert parts["model"] == name and set(parts["seconds"]) == {"load", "serving", "evals facts_mc",
                                                                    "fidelity and probes"}
        assert all(v >= 0 for v in parts["seconds"].values()) and parts["seconds"]["load"] == measured.metrics["load_s"]


def test_the_prefill_point_keeps_the_median_of_its_calls_on_the_real_engine(tiny_model_dir):
    """A round's prefill figure is the median over `prefill_calls` fresh prompts, each timed alone through the
    engine: one slow call (a scheduler hiccup) cannot move it. The plan records the calls beside the point."""
    from flows import speed_rounds

    engine = speed_rounds.load_engine(Variant(BASELINE, None, str(tiny_model_dir), "b"), PLAN)
    calls: list[int] = []
    real_generate = engine.generate

    def generate(prompts, params):
        calls.append(len(prompts))
        if len(calls) == 2:  # the second call stalls: a hiccup the median must not see
            import time

            time.sleep(0.5)
        return real_generate(prompts, params)

    engine.generate = generate
    prompts = [[1000 + i + j for j in range(8)] for i in range(3)]
    tps = speed_rounds.time_prefill(engine, prompts)
    assert calls == [1, 1, 1]
    assert tps > 8 / 0.5  # the stalled call's rate (below 16 tok/s) is not the median
    assert PLAN.shape("prefill")["calls"] == 3 and M.speed_point("prefill", "calls") == "serve/point/prefill/calls"
