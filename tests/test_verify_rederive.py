"""gates/evidence/rederive.py: the metrics `quantgate verify` recomputes from a run's per-item records agree with
independent numpy implementations of the release's statistics (same seeds, same resample indices).

Crafted records in the layout a run's `evidence/` folder has (`<suite>/samples/<task>.jsonl` + summary,
fidelity.json, long_context.json, speed.json); no MLflow (tests/test_evidence.py covers verify end to end).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest

from evals.results import EvalResult, SampleResult, TaskResult
from gates import metric_names as M
from gates.evidence import rederive as R

N = 120


def _task(name: str, metric: str, correct: list[bool], suite: str = "accuracy") -> TaskResult:
    samples = [SampleResult(i, f"{name}-{i:04d}", target="t", response="r", score=float(ok), correct=ok)
               for i, ok in enumerate(correct)]
    return TaskResult(name, suite, metric, sum(correct) / len(correct), len(correct), True, True, 0.0, False, 0,
                      samples=samples)


def _evidence(root: Path, arith: list[bool], refused: list[bool]) -> Path:
    EvalResult("m", "engine", ["accuracy"], None, "2026-12-05", {"arith": _task("arith", "exact_match", arith)}
               ).save(root / "accuracy")
    EvalResult("m", "engine", ["safety"], None, "2026-12-05",
               {"refusal": _task("refusal", "refusal_rate", refused, "safety")}).save(root / "safety")
    return root


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    base = rng.random(N) < 0.7
    var = np.where(rng.random(N) < 0.12, ~base, base)  # ~12 % of the items flip either way
    b = _evidence(tmp_path / "base", base.tolist(), (rng.random(40) < 0.9).tolist())
    v = _evidence(tmp_path / "var", var.tolist(), (rng.random(40) < 0.8).tolist())
    return b, v, base.astype(float), var.astype(float)


def test_the_task_ci_is_the_independent_numpy_bootstrap_on_the_same_indices(pair):
    base_dir, var_dir, b, v = pair
    derived = R.derive_pair(base_dir, var_dir, "int8wo", "baseline")
    assert not derived.problems
    seed = (20261129 + zlib.crc32(b"int8wo/arith")) % 2**32  # evals.compare: DEFAULT_SEED + crc32(variant/task)
    idx = np.random.default_rng(seed).integers(0, N, size=(2000, N))
    deltas = v[idx].mean(axis=1) - b[idx].mean(axis=1)
    low, high = np.percentile(deltas, [2.5, 97.5])
    assert derived.metrics[M.task_delta_ci_low("arith")] == pytest.approx(low, abs=1e-12)
    assert derived.metrics[M.task_delta_ci_high("arith")] == pytest.approx(high, abs=1e-12)
    assert derived.metrics[M.task_delta("arith")] == pytest.approx(v.mean() - b.mean(), abs=1e-12)
    assert derived.metrics[M.task_score("arith")] == pytest.approx(v.mean()) and derived.metrics["task/arith/n"] == N
    flips = float(np.sum(b != v)) / N
    assert derived.flip_rates["arith"] == pytest.approx(flips)


def test_safety_rates_pool_every_refusal_item(pair):
    base_dir, var_dir, _, _ = pair
    refused = [json.loads(line)["score"] for line in (var_dir / "safety/samples/refusal.jsonl").read_text().splitlines()]
    assert R.derive_model(var_dir).metrics[M.SAFETY_REFUSAL_RATE] == pytest.approx(sum(refused) / len(refused))
    assert R.rederived("safety/refusal_rate/max_fall", R.derive_model(var_dir), R.derive_model(base_dir))
    assert not R.rederived("safety/refusal_rate/max_fall", R.derive_model(var_dir), None)


def _fidelity(path: Path, tops: list, seed: int = 3) -> None:
    path.write_text(json.dumps({"plan": {"seed": seed}, "text_sha256": "x", "tokens": [[0] * 6] * len(tops),
                                "top": tops}))


def _tops(rng: np.random.Generator, chunks: int, positions: int) -> list:
    out = []
    for _ in range(chunks):
        chunk = []
        for _ in range(positions):
            ids = rng.permutation(10)[:3].tolist()
            probs = np.sort(rng.dirichlet(np.ones(4)))[::-1][:3]
            chunk.append([ids, np.log(probs).tolist()])
        out.append(chunk)
    return out


def test_fidelity_flip_ci_is_the_independent_cluster_bootstrap(tmp_path):
    rng = np.random.default_rng(1)
    base, var = _tops(rng, 8, 5), _tops(rng, 8, 5)
    for d, tops in (("b", base), ("v", var)):
        (tmp_path / d).mkdir()
        _fidelity(tmp_path / d / R.FIDELITY_FILE, tops)
    derived = R.derive_pair(tmp_path / "b", tmp_path / "v", "int4", "baseline")
    flips = np.array([sum(bp[0][0] != vp[0][0] for bp, vp in zip(bc, vc, strict=True))
                      for bc, vc in zip(base, var, strict=True)], dtype=float)
    idx = np.random.default_rng(3 + 1).integers(0, 8, size=(2000, 8))  # evals.fidelity: plan seed + 1 for flips
    low, high = np.percentile(flips[idx].sum(axis=1) / (5 * 8), [2.5, 97.5])
    assert derived.metrics["fidelity/flip_rate"] == pytest.approx(flips.sum() / 40)
    assert derived.metrics["fidelity/flip_rate_ci_low"] == pytest.approx(low, abs=1e-12)
    assert derived.metrics["fidelity/flip_rate_ci_high"] == pytest.approx(high, abs=1e-12)
    assert derived.metrics["fidelity/kl_ci_low"] <= derived.metrics["fidelity/kl"] <= derived.metrics["fidelity/kl_ci_high"]
    assert R.rederived("fidelity/kl/max", derived, None) and R.gate_of("fidelity/kl_ci_high") == "fidelity/kl/max"
    _fidelity(tmp_path / "v" / R.FIDELITY_FILE, var[:7])  # a chunk short: the records do not pair
    assert any("fidelity" in p for p in R.derive_pair(tmp_path / "b", tmp_path / "v", "int4", "baseline").problems)


def _probes(path: Path, correct: list[bool], length: int = 512) -> None:
    answers = [{"length": length, "depth": 0.5, "key": str(10000 + i), "answer": "a", "correct": ok}
               for i, ok in enumerate(correct)]
    path.write_text(json.dumps({"plan": {}, "answers": answers}))


def test_long_context_ci_is_the_independent_paired_bootstrap(tmp_path):
    rng = np.random.default_rng(2)
    b, v = rng.random(30) < 0.9, rng.random(30) < 0.7
    for d, ok in (("b", b), ("v", v)):
        (tmp_path / d).mkdir()
        _probes(tmp_path / d / R.PROBES_FILE, ok.tolist())
    derived = R.derive_pair(tmp_path / "b", tmp_path / "v", "int4wo+kv8", "baseline")
    idx = np.random.default_rng(0 + 512).integers(0, 30, size=(2000, 30))  # seed 0 + length, as the release
    low, high = np.percentile(v[idx].mean(axis=1) - b[idx].mean(axis=1), [2.5, 97.5])
    assert derived.metrics["long_context/512/delta_ci_low"] == pytest.approx(low, abs=1e-12)
    assert derived.metrics["long_context/512/delta_ci_high"] == pytest.approx(high, abs=1e-12)
    assert R.rederived("long_context/512/max_drop", derived, None)
    assert not R.rederived("long_context/1024/max_drop", derived, None)


def _speed(path: Path, plan: dict, rounds: dict) -> None:
    path.write_text(json.dumps({"machine": "m", "plan": plan, "rounds": rounds, "metrics": {}}))


def test_speed_ci_is_the_independent_t_interval_and_an_unknown_plan_is_only_hash_checked(tmp_path):
    base = [100.0, 104.0, 98.0, 101.0, 99.0]
    var = [120.0, 118.0, 125.0, 119.0, 121.0]
    rounds = {"baseline": {"decode_b4": base}, "int8wo": {"decode_b4": var}}
    plan = {"decode_batches": [4], "decode_tokens": 8, "decode_context": 8, "prefill_tokens": 64, "rounds": 5,
            "warmup_rounds": 1, "seed": 0, "device": "cpu"}
    _speed(tmp_path / R.SPEED_FILE, plan, rounds)
    derived = R.derive_pair(None, tmp_path, "int8wo", "baseline")
    logs = np.log(np.array(var) / np.array(base))
    half = 2.776 * logs.std(ddof=1) / math.sqrt(5)  # two-sided 95 % t quantile at 4 degrees of freedom
    assert derived.metrics["serve/decode_speedup_b4"] == pytest.approx(math.exp(logs.mean()))
    assert derived.metrics["serve/decode_speedup_b4_ci_low"] == pytest.approx(math.exp(logs.mean() - half))
    assert derived.metrics["serve/decode_speedup_b4_ci_high"] == pytest.approx(math.exp(logs.mean() + half))
    assert derived.metrics[M.SERVE_SPEED_ROUNDS] == 5 and derived.metrics["serve/paired_decode_b4_tps"] == 120.0
    assert R.rederived("serve/min_decode_speedup/b4", derived, None)
    assert R.gate_of("serve/decode_speedup_b4_ci_low") == "serve/min_decode_speedup/b4"
    _speed(tmp_path / R.SPEED_FILE, {**plan, "looks": [5, 10]}, rounds)  # a design this verify does not know
    derived = R.derive_pair(None, tmp_path, "int8wo", "baseline")
    assert not derived.metrics and "hash-checked only" in derived.notes[0]
    assert not R.rederived("serve/min_decode_speedup/b4", derived, None)


def test_gates_without_item_records_are_never_called_rederived(pair):
    base_dir, var_dir, _, _ = pair
    derived = R.derive_pair(base_dir, var_dir, "int8wo", "baseline")
    assert R.rederived("task/arith/max_drop", derived, R.derive_model(base_dir))
    for gate in ("weights/min_reduction", "capacity/min_gain", "serve/max_tpot_p99_s", "canary/min_tpot_speedup"):
        assert not R.rederived(gate, derived, R.derive_model(base_dir))
    assert R.gate_of("task/arith/delta_ci_low") == "task/arith/max_drop" and R.gate_of("weights/bytes") == "no gate"
