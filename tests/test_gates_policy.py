"""The policy file and the gate arithmetic, without a store: strict parsing, CI-bound judging."""

from __future__ import annotations

import pytest
from gates_fixtures import BAD_ARC, BASELINE, GOOD, POLICY_YAML

from gates import metric_names as M
from gates.judging.judge import judge
from gates.judging.policy import DEFAULT_POLICY, PolicyError, load_policy, parse_policy
from gates.judging.verdicts import NOT_MEASURED


def _policy(tmp_path, text: str = POLICY_YAML):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return load_policy(path)


def test_default_policy_loads_with_every_gate_family():
    policy = load_policy()
    assert policy.source == str(DEFAULT_POLICY)
    assert policy.tasks.max_drop == 0.05 and policy.tasks.higher_is_better
    assert policy.min_weight_reduction == 0.40 and policy.min_decode_speedup == 1.0  # slower never ships
    assert policy.canary_max_error_rate == 0.01
    assert len(policy.sha256) == 64


def test_the_default_policy_gates_the_real_benchmarks_the_default_suites_run():
    from evals.tasks import resolve_tasks
    from flows.data import DEFAULT_SUITES

    policy = load_policy()
    real = {"arc_easy", "piqa", "hellaswag", "winogrande", "mmlu_marketing", "mmlu_high_school_geography",
            "mmlu_high_school_psychology"}
    assert real <= set(policy.required_tasks)
    assert set(policy.required_tasks) <= {t.name for t in resolve_tasks(list(DEFAULT_SUITES))}  # none fails unmeasured
    results = judge(policy, {}, {})
    assert {r.name for r in results if "not recorded" in r.reason} >= {f"task/{t}/max_drop" for t in real}


def test_the_demo_policy_refuses_a_variant_that_decodes_slower():
    from pathlib import Path

    demo = load_policy(Path(__file__).resolve().parents[1] / "flows" / "demo_policy.yaml")
    assert demo.min_decode_speedup == 1.0 and demo.decode_batches == (1, 4, 16)
    assert demo.min_prefill_speedup == 0.8 and demo.uninformative_blocks("serving")

    def at_b4(low: float, high: float) -> dict[str, float]:  # the paired ratio's CI at the flow's 4 streams
        key = M.decode_speedup(4)
        return {key: (low * high) ** 0.5, M.ci(key, "ci_low"): low, M.ci(key, "ci_high"): high,
                M.SERVE_SPEED_ROUNDS: 5}

    slower = {r.name: r for r in judge(demo, at_b4(0.93, 0.97), {})}
    faster = {r.name: r for r in judge(demo, at_b4(1.4, 1.6), {})}
    assert not slower["serve/min_decode_speedup/b4"].passed and slower["serve/min_decode_speedup/b4"].verdict == "fail"
    assert slower["serve/min_decode_speedup/b4"].observed == pytest.approx(0.95, abs=1e-3)
    assert faster["serve/min_decode_speedup/b4"].passed
    assert "not measured" in faster["serve/min_decode_speedup/b1"].reason  # every operating point is judged


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("  max_drop: 0.05\n", "  max_dorp: 0.05\n  max_drop: 0.05\n", "unknown key 'tasks.max_dorp'"),
        ("weights:\n", "weight:\n  min_reduction: 0.1\nweights:\n", "unknown key 'weight'"),
        ("hellaswag: {max_drop: 0.10}", "hellaswag: {max_drop: 0.10, skip: true}", "unknown key 'tasks.overrides.hellaswag.skip'"),
        ("  max_tpot_p99_s: 1.0\ncanary", "  max_tpot_p99_s: fast\ncanary", "serving.max_tpot_p99_s: expected a number or null, got 'fast'"),
        ("  min_reduction: 0.5", "  min_reduction: 50", "weights.min_reduction: expected a fraction in [0, 1], got 50.0"),
        ("  max_drop: 0.05\n", "  max_drop: null\n", "tasks.max_drop: expected a number, got None"),
        ("  max_drop: 0.05\n", "  max_drop: 0.05\n  higher_is_better: yes please\n", "tasks.higher_is_better: expected true or false"),
        ("safety:\n  refusal_rate_max_fall: 0.05\n  over_refusal_rate_max_rise: 0.05\n", "safety: 0.05\n",
         "safety: expected a mapping"),
        ("version: 1", "version: 2", "unsupported policy version 2"),
    ],
)
def test_policy_errors_name_the_key_and_the_file(tmp_path, old, new, message):
    assert old in POLICY_YAML
    with pytest.raises(PolicyError) as error:
        _policy(tmp_path, POLICY_YAML.replace(old, new, 1))
    assert message in str(error.value)
    assert str(tmp_path / "policy.yaml") in str(error.value)


def test_missing_policy_file_is_a_clear_error(tmp_path):
    with pytest.raises(PolicyError, match="policy file not found"):
        load_policy(tmp_path / "nope.yaml")


def test_task_gates_judge_the_ci_bound_with_overrides(tmp_path):
    policy = _policy(tmp_path)
    results = {r.name: r for r in judge(policy, GOOD, BASELINE)}
    assert all(r.passed for r in results.values())
    # hellaswag's CI low -0.08 would fail the default 0.05 but its override allows 0.10
    assert results["task/hellaswag/max_drop"].threshold == -0.10
    bad = {r.name: r for r in judge(policy, BAD_ARC, BASELINE)}
    assert not bad["task/arc/max_drop"].passed  # point delta -0.03 is fine, the CI bound -0.09 is not
    # ... and its CI (half-width 0.06) is wider than the margin: uninformative, and that always blocks
    assert bad["task/arc/max_drop"].verdict == "uninformative"
    assert bad["task/arc/max_drop"].reason.endswith("measured -0.09 < -0.05 (point delta -0.03, n=60)")


def test_lower_is_better_tasks_judge_the_upper_bound():
    policy = parse_policy({"tasks": {"max_drop": 0.5, "overrides": {"ppl": {"higher_is_better": False}}}})
    worse = M.task_metrics("ppl", 12.0, delta=0.4, ci_low=0.2, ci_high=0.7)
    [result] = judge(policy, worse, {})
    assert result.name == "task/ppl/max_drop" and not result.passed
    assert result.observed == 0.7 and result.threshold == 0.5
    better = M.task_metrics("ppl", 11.0, delta=-0.4, ci_low=-0.7, ci_high=0.1)
    assert judge(policy, better, {})[0].passed


def test_not_measured_fails():
    policy = parse_policy({"tasks": {"max_drop": 0.05, "required": ["mmlu"]}, "serving": {"min_decode_speedup": 1.2}})
    results = {r.name: r for r in judge(policy, GOOD, BASELINE)}
    assert not results["task/mmlu/max_drop"].passed
    assert results["task/mmlu/max_drop"].reason == f"{NOT_MEASURED}: task/mmlu/delta_ci_low (variant) not recorded"
    speed = results["serve/min_decode_speedup/b1"]  # the unpaired decode_tps of one benchmark is no evidence
    assert speed.observed is None and not speed.passed and "serve/decode_speedup_b1 not recorded" in speed.reason
    [nothing] = judge(parse_policy({"tasks": {"max_drop": 0.05}}), {}, None)
    assert nothing.name == "tasks/any_measured" and not nothing.passed
    canary = judge(load_policy(), {M.CANARY_TPOT_P99_S: 0.5}, None, stage="canary")
    assert [(r.name, r.passed) for r in canary] == [("canary/max_error_rate", False), ("canary/max_tpot_p99_s", True),
                                                    ("canary/min_tpot_speedup", False)]
    with pytest.raises(ValueError, match="unknown gate stage"):
        judge(load_policy(), {}, None, stage="prod")


def test_metric_names_are_one_convention():
    assert M.task_metrics("arc_easy", 0.5, -0.01, -0.03, 0.01, 200) == {
        "task/arc_easy/score": 0.5,
        "task/arc_easy/delta": -0.01,
        "task/arc_easy/delta_ci_low": -0.03,
        "task/arc_easy/delta_ci_high": 0.01,
        "task/arc_easy/n": 200.0,
    }
    assert M.latency("tpot", 99) == M.SERVE_TPOT_P99_S == "serve/tpot_p99_s"
    assert M.tasks_in([*GOOD, "task/x/other", "serve/decode_tps"]) == {"arc", "hellaswag"}
    with pytest.raises(ValueError, match="cannot be a metric key"):
        M.task_score("arc easy?")
    with pytest.raises(ValueError, match="'weights/bytes' is inf"):
        M.check_metrics({"weights/bytes": float("inf")})


def test_the_speed_section_names_the_points_and_its_errors_name_the_key():
    policy = load_policy()
    assert (policy.speed.prefill_tokens, policy.speed.decode_context, policy.speed.decode_steps) == (512, 384, 64)
    assert policy.speed.long_context == 2048 and policy.speed.spending == "pocock"
    from pathlib import Path

    demo = load_policy(Path(__file__).resolve().parents[1] / "flows" / "demo_policy.yaml")
    assert demo.speed.time_budget_s == 90  # the demo's speed stage on 2 cores
    base = {"tasks": {"max_drop": 0.05}}
    assert parse_policy({**base, "speed": {"long_context": None}}).speed.long_context == 0
    for bad, message in (({"spending": "linear"}, "pocock or obrien-fleming"),
                         ({"look_every": 2}, "integer >= 3"),
                         ({"max_rounds": 4}, "max_rounds \\(4\\) < look_every \\(5\\)"),
                         ({"prefill_tokens": 0}, "integer >= 1"),
                         ({"decode_steps": 64, "typo": 1}, "typo")):
        with pytest.raises(PolicyError, match=message):
            parse_policy({**base, "speed": bad})
