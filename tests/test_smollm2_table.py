"""benchmarks/smollm2_table.py joins shards of a long run (crafted reports): items concatenated in order,
scores recomputed over all of them, overlaps and mismatched coverage refused."""

from __future__ import annotations

import pytest

from benchmarks.smollm2_table import merge_reports


def _report(backend: str, docs: list[list[int]] | None, limit: int | None, items: list[tuple[int, int, int]]):
    scored = [{"doc_id": d, "pred": acc, "lls": [0.0, -1.0], "acc": float(acc), "acc_norm": float(norm)}
              for d, acc, norm in items]
    task = {"n": len(scored), "acc": sum(i["acc"] for i in scored) / len(scored),
            "acc_norm": sum(i["acc_norm"] for i in scored) / len(scored), "items": scored}
    return {"model": "m", "model_dir": "/m", "limit": limit, "docs": docs, "dtype": "float32", "tasks": ["hellaswag"],
            "results": {backend: {"load_s": 1.0, "eval_s": 2.0, "cpu_s": 3.0, "tasks": {"hellaswag": task}}}}


def test_shards_of_each_backend_are_joined_and_compared():
    first = [(0, 1, 1), (1, 0, 1)]  # a --limit 2 run covers items 0..1
    second = [(2, 1, 0), (3, 1, 1), (4, 0, 0)]
    reports = [_report("engine", [[2, 5]], None, second), _report("engine", None, 2, first),
               _report("hf", None, 2, first), _report("hf", [[2, 5]], None, [(2, 1, 0), (3, 0, 1), (4, 0, 0)])]
    merged = merge_reports(reports)
    assert merged["docs"] == [[0, 2], [2, 5]]
    engine = merged["results"]["engine"]["tasks"]["hellaswag"]
    assert [i["doc_id"] for i in engine["items"]] == [0, 1, 2, 3, 4]
    assert engine["n"] == 5 and engine["acc"] == pytest.approx(3 / 5) and engine["acc_norm"] == pytest.approx(3 / 5)
    assert merged["results"]["engine"]["eval_s"] == 4.0
    comparison = merged["comparison"]["hellaswag"]
    assert comparison["paired"] == 5 and comparison["pred_agreement"] == pytest.approx(4 / 5)
    assert comparison["delta_acc"] == pytest.approx(1 / 5)


def test_overlapping_shards_and_uneven_coverage_are_refused():
    a = _report("engine", [[0, 2]], None, [(0, 1, 1), (1, 0, 1)])
    b = _report("engine", [[1, 3]], None, [(1, 1, 1), (2, 0, 1)])
    with pytest.raises(ValueError, match="overlap"):
        merge_reports([a, b])
    c = _report("engine", [[2, 3]], None, [(2, 0, 1)])
    hf = _report("hf", [[0, 2]], None, [(0, 1, 1), (1, 0, 1)])
    with pytest.raises(ValueError, match="different items"):
        merge_reports([a, c, hf])


def _summary(report: dict) -> dict:
    """What docs/results keeps of a merged run: counts and comparisons, no items."""
    for res in report["results"].values():
        for task in res["tasks"].values():
            task.pop("items")
    return report


def test_a_committed_summary_folds_in_new_shards_by_counts():
    first = [(0, 1, 1), (1, 0, 1)]
    summary = _summary(merge_reports([_report("engine", [[0, 2]], None, first),
                                      _report("hf", [[0, 2]], None, [(0, 1, 1), (1, 1, 0)])]))
    new = [_report("engine", [[2, 5]], None, [(2, 1, 0), (3, 1, 1), (4, 0, 0)]),
           _report("hf", [[2, 5]], None, [(2, 1, 0), (3, 1, 1), (4, 0, 0)])]
    merged = merge_reports([summary, *new])
    assert merged["docs"] == [[0, 2], [2, 5]]
    engine, hf = (merged["results"][b]["tasks"]["hellaswag"] for b in ("engine", "hf"))
    assert engine["n"] == 5 and engine["acc"] == pytest.approx(3 / 5) and engine["acc_norm"] == pytest.approx(3 / 5)
    assert hf["acc"] == pytest.approx(4 / 5) and hf["acc_norm"] == pytest.approx(2 / 5)
    assert "items" not in engine and merged["results"]["engine"]["eval_s"] == 4.0
    comparison = merged["comparison"]["hellaswag"]
    assert comparison["paired"] == 5 and comparison["pred_agreement"] == pytest.approx(4 / 5)
    assert comparison["delta_acc"] == pytest.approx(1 / 5) and not comparison["within_target"]
    with pytest.raises(ValueError, match="overlap"):
        merge_reports([summary, _report("engine", [[1, 3]], None, [(1, 1, 1), (2, 0, 1)]),
                       _report("hf", [[1, 3]], None, [(1, 1, 1), (2, 0, 1)])])
