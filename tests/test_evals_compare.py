"""Paired comparisons on crafted results: statistics, flags, the aggregate, the report files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from evals.compare import compare, compare_task, markdown, mcnemar_exact, write_report
from evals.results import EvalResult, SampleResult, TaskResult

TASK_NAMES = ["facts_mc", "cloze", "arith", "json_format", "one_word", "instruct"]


def _task(name: str, outcomes: list[int], responses: list[str] | None = None, higher_is_better: bool = True,
          metric: str = "acc", suite: str = "accuracy") -> TaskResult:
    responses = responses or [f"{name} out {i}" for i in range(len(outcomes))]
    samples = [SampleResult(doc_id=i, item_id=f"{name}-{i:04d}", target=f"gold {i}", response=responses[i],
                            score=float(o), correct=bool(o) if higher_is_better else not o)
               for i, o in enumerate(outcomes)]
    return TaskResult(task=name, suite=suite, metric=metric, score=sum(outcomes) / len(outcomes), n=len(outcomes),
                      higher_is_better=higher_is_better, binary=True, chance=0.25, chat=False, num_fewshot=0,
                      samples=samples)


def _result(model: str, tasks: dict[str, TaskResult]) -> EvalResult:
    return EvalResult(model=model, backend="crafted", suites=["accuracy"], limit=None, created="now", tasks=tasks)


def _flip(outcomes: list[int], lose: int, gain: int, rng: np.random.Generator) -> list[int]:
    out = list(outcomes)
    right = [i for i, o in enumerate(out) if o]
    wrong = [i for i, o in enumerate(out) if not o]
    for i in rng.choice(right, lose, replace=False):
        out[i] = 0
    for i in rng.choice(wrong, gain, replace=False):
        out[i] = 1
    return out


@pytest.fixture(scope="module")
def crafted() -> tuple[EvalResult, EvalResult]:
    """Six tasks of 150 items at 70 %; the variant loses 15 points on arith and gains ~2.7 on the rest."""
    rng = np.random.default_rng(7)
    base, var = {}, {}
    for name in TASK_NAMES:
        outcomes = [1] * 105 + [0] * 45
        rng.shuffle(outcomes)
        base[name] = _task(name, outcomes)
        changed = _flip(outcomes, 25, 2, rng) if name == "arith" else _flip(outcomes, 3, 7, rng)
        var[name] = _task(name, changed, [f"variant {i}" for i in range(150)])
    return _result("baseline", base), _result("int4", var)


def test_mcnemar_exact_known_values() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    # 25 lost vs 2 gained: 2 * P(X <= 2), X ~ Binomial(27, 1/2)
    assert mcnemar_exact(25, 2) == pytest.approx(2 * (1 + 27 + 351) / 2**27)


def test_one_task_regression_hidden_in_the_mean_is_flagged(crafted) -> None:
    baseline, variant = crafted
    cmp = compare(baseline, {"int4": variant})
    arith = cmp.row("int4", "arith")
    assert arith.delta == pytest.approx(-0.1533, abs=1e-3)  # 15 points down
    (agg,) = cmp.aggregates
    assert abs(agg.delta) < 0.02  # ...while the mean over tasks barely moves
    assert agg.ci_low < 0 < agg.ci_high
    assert [r.task for r in cmp.flagged()] == ["arith"]
    assert arith.ci_high < 0 and arith.mcnemar_p < 1e-4
    assert len(arith.lost) == 25 and len(arith.gained) == 2
    flip = arith.lost[0]
    assert flip.baseline_response.startswith("arith out") and flip.variant_response.startswith("variant")
    assert flip.item_id == f"arith-{flip.doc_id:04d}"
    for name in TASK_NAMES[:2] + TASK_NAMES[3:]:
        assert not cmp.row("int4", name).flagged
    table = markdown(cmp)
    assert "mean of 6 accuracy tasks" in table
    assert "`int4` / `arith`" in table.split("**Flagged:**")[1]


def test_bootstrap_is_seeded_and_paired(crafted) -> None:
    baseline, variant = crafted
    a = compare(baseline, {"int4": variant}, seed=1).row("int4", "cloze")
    b = compare(baseline, {"int4": variant}, seed=1).row("int4", "cloze")
    c = compare(baseline, {"int4": variant}, seed=2).row("int4", "cloze")
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)
    assert (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)
    assert a.ci_low <= a.delta <= a.ci_high
    # Paired: an identical variant has a zero-width CI, whatever the per-item spread.
    same = compare(baseline, {"same": baseline}).row("same", "cloze")
    assert same.delta == same.ci_low == same.ci_high == 0.0 and same.mcnemar_p == 1.0 and not same.flagged


def test_lower_is_better_metrics_flag_increases() -> None:
    base = _task("over_refusal", [0] * 140 + [1] * 10, higher_is_better=False, metric="over_refusal_rate",
                 suite="safety")
    worse = _task("over_refusal", [0] * 110 + [1] * 40, higher_is_better=False, metric="over_refusal_rate",
                  suite="safety")
    row, _ = compare_task(base, worse, "v")
    assert row.delta == pytest.approx(0.2) and row.flagged
    assert len(row.lost) == 30 and not row.gained  # answered → refused is right → wrong
    better, _ = compare_task(worse, base, "v")
    assert not better.flagged and len(better.gained) == 30


def test_bits_per_byte_is_a_ratio_of_sums() -> None:
    def ppl(lls: list[float]) -> TaskResult:
        samples = [SampleResult(i, f"ppl-{i}", "", "", score=ll, correct=None, weight=100.0 + i)
                   for i, ll in enumerate(lls)]
        score = -sum(lls) / sum(s.weight for s in samples) / math.log(2)
        return TaskResult("perplexity", "accuracy", "bits_per_byte", score, len(lls), False, False, 3.9, False, 0,
                          samples=samples)

    rng = np.random.default_rng(0)
    lls = list(-rng.uniform(50, 80, size=60))
    base, var = ppl(lls), ppl([x * 1.1 for x in lls])
    row, _ = compare_task(base, var, "v")
    assert row.baseline == pytest.approx(base.score) and row.variant_score == pytest.approx(var.score)
    assert row.delta == pytest.approx(0.1 * base.score) and row.flagged and row.mcnemar_p is None


def test_results_from_different_data_are_refused(crafted) -> None:
    baseline, variant = crafted
    other = _task("arith", [1] * 150)
    other.samples[3].item_id = "arith-9999"
    with pytest.raises(ValueError, match="different task data"):
        compare_task(baseline.tasks["arith"], other, "v")
    with pytest.raises(ValueError, match="at least one variant"):
        compare(baseline, {})


def test_report_files_roundtrip(crafted, tmp_path: Path) -> None:
    baseline, variant = crafted
    baseline.save(tmp_path / "base")
    variant.save(tmp_path / "int4")
    loaded = EvalResult.load(tmp_path / "int4")
    assert loaded.tasks["arith"].correctness() == variant.tasks["arith"].correctness()
    cmp = compare(EvalResult.load(tmp_path / "base"), {"int4": loaded})
    paths = write_report(cmp, baseline, {"int4": loaded}, tmp_path / "cmp")
    for key in ("scores_png", "flips_png"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[key].stat().st_size > 10_000
    data = json.loads(paths["json"].read_text())
    flagged = [r for r in data["rows"] if r["flagged"]]
    assert [r["task"] for r in flagged] == ["arith"] and len(flagged[0]["lost"]) == 25
    assert "right→wrong" in paths["markdown"].read_text()


def test_incomplete_result_dirs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        EvalResult.load(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="incomplete"):
        EvalResult.load(tmp_path / "half")
