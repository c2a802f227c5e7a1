"""The release summary never counts a gate that could not have failed as a pass."""

from __future__ import annotations

from flows.summary import _gates, _stopped_text


def test_uninformative_gates_are_counted_apart_from_passes():
    row = {"gates_passed": True, "gates_total": 15, "gates_failed": [],
           "gates_uninformative": ["safety/refusal_rate/max_fall", "task/harmbench/max_drop", "task/advbench/max_drop"]}
    assert _gates(row) == "12/15 passed, 3 uninformative"
    blocked = {**row, "gates_passed": False, "gates_failed": ["task/harmbench/max_drop", "task/arith/max_drop"]}
    assert _gates(blocked) == "11/15 passed, 3 uninformative (1 blocking)"  # a blocking one is not a pass
    assert _stopped_text(blocked) == "failed: task/arith/max_drop; blocked as uninformative: task/harmbench/max_drop"
    assert _gates({"gates_passed": True, "gates_total": 4, "gates_failed": []}) == "4/4 passed"
    assert _gates({"gates_passed": None, "gates_total": 0, "gates_failed": []}) == "—"


def test_a_report_on_the_default_model_says_its_baseline_is_4_bit():
    from flows.summary import render_markdown
    from quantgate.models import DEFAULT_MODEL, DEFAULT_MODEL_NOTE

    data = {"model": DEFAULT_MODEL, "source_hash": "0" * 64, "flow_run_id": "f", "release_run_id": "r",
            "outcome": "nothing promoted", "rows": [], "tracking_uri": "sqlite:////tmp/m.db"}
    assert "Q4_1" in DEFAULT_MODEL_NOTE and DEFAULT_MODEL_NOTE in render_markdown(data)
    assert DEFAULT_MODEL_NOTE not in render_markdown({**data, "model": "my-model"})
