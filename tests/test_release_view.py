"""What a release manager sees first in MLflow, on crafted verdicts: the run note's words and figures, the gate
table, the plots' colours and thresholds, and approval words that agree with the gates."""

from __future__ import annotations

import pytest

from gates import metric_names as M
from gates.judging.policy import parse_policy
from gates.judging.verdicts import UNINFORMATIVE, Evaluation, GateResult
from gates.records import release_plots as RP
from gates.records import run_notes as N


def _gate(name: str, verdict: str, observed: float | None, threshold: float, passed: bool | None = None,
          underpowered: bool = False) -> GateResult:
    passed = verdict == "pass" or (verdict == UNINFORMATIVE) if passed is None else passed
    return GateResult(name, "release", "rule", threshold, observed, passed, f"{name} reason", verdict,
                      harmless_pass=0.5 if name.startswith("task/") else None, underpowered=underpowered)


METRICS = {
    **M.task_metrics("arc", 0.6, -0.02, -0.05, 0.01, n=40),   # pass
    **M.task_metrics("piqa", 0.5, -0.12, -0.20, -0.04, n=40),  # fail: CI low below -0.15
    **M.task_metrics("boolq", 0.7, 0.0, -0.10, 0.10, n=40),   # uninformative
    **M.task_metrics("cloze", 0.4, 0.01, -0.08, 0.09, n=20),  # pass, underpowered
    M.decode_speedup(1): 1.10, M.ci(M.decode_speedup(1), "ci_low"): 1.05, M.ci(M.decode_speedup(1), "ci_high"): 1.15,
    M.decode_speedup(16): 0.935, M.ci(M.decode_speedup(16), "ci_low"): 0.91,
    M.ci(M.decode_speedup(16), "ci_high"): 0.96, M.speed_point("decode_b16", "rounds"): 8,
    M.SERVE_PREFILL_SPEEDUP: 1.0, M.ci(M.SERVE_PREFILL_SPEEDUP, "ci_low"): 0.7,
    M.ci(M.SERVE_PREFILL_SPEEDUP, "ci_high"): 1.3, M.SERVE_SPEED_ROUNDS: 12,
}
RESULTS = [
    _gate("task/arc/max_drop", "pass", -0.05, -0.15),
    _gate("task/piqa/max_drop", "fail", -0.20, -0.15),
    _gate("task/boolq/max_drop", UNINFORMATIVE, -0.10, -0.15),
    _gate("task/cloze/max_drop", "pass", -0.08, -0.15, underpowered=True),
    _gate("serve/min_decode_speedup/b1", "pass", 1.10, 1.0),
    _gate("serve/min_decode_speedup/b16", "fail", 0.935, 1.0),
    _gate("serve/min_prefill_speedup", UNINFORMATIVE, 1.0, 0.8, passed=False),
]
EVALUATION = Evaluation("run1", "release", RESULTS, policy_sha256="ab" * 32, extra={"machine": "Xeon, bfloat16"})


def _colours(fig) -> dict[str, str]:
    from matplotlib.colors import to_hex

    ax = fig.axes[0]
    return {line.get_gid(): to_hex(line.get_color()) for line in ax.lines if line.get_gid()}


def test_task_deltas_are_coloured_by_verdict_with_the_threshold_drawn():
    from matplotlib.colors import to_hex

    policy = parse_policy({"version": 1, "tasks": {"max_drop": 0.15}})
    fig = RP.task_delta_figure(METRICS, policy, "int4", verdicts={r.name: r for r in RESULTS})
    colours = _colours(fig)
    expected = {"arc": "pass", "piqa": "fail", "boolq": UNINFORMATIVE, "cloze": "underpowered"}
    for task, kind in expected.items():
        assert colours[f"task:{task}:{kind}"] == to_hex(RP.VERDICT_COLOURS[kind])
    thresholds = [line for line in fig.axes[0].lines if line.get_linestyle() == "--"]
    assert len(thresholds) == 4 and all(list(line.get_xdata()) == [-0.15, -0.15] for line in thresholds)
    assert "4 task gates" in fig.axes[0].get_title()
    assert any("(n=40)" in t.get_text() for t in fig.axes[0].get_yticklabels())


def test_speed_plot_marks_the_failing_point_against_its_minimum():
    from matplotlib.colors import to_hex

    fig = RP.speed_figure(METRICS, RESULTS, "int4")
    colours = _colours(fig)
    assert colours["speed:serve/min_decode_speedup/b16:fail"] == to_hex(RP.VERDICT_COLOURS["fail"])
    assert colours["speed:serve/min_decode_speedup/b1:pass"] == to_hex(RP.VERDICT_COLOURS["pass"])
    assert colours[f"speed:serve/min_prefill_speedup:{UNINFORMATIVE}"] == to_hex(RP.VERDICT_COLOURS[UNINFORMATIVE])
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0].startswith("prefill") and labels[-1].startswith("decode_b16 (n=8 rounds)")  # batches in order
    assert any(t.get_text().startswith("FAIL 0.935") for t in fig.axes[0].texts)
    assert "3 speed gates" in fig.axes[0].get_title()


def test_comparison_draws_paired_speedups_and_marks_failures():
    fig = RP.comparison_figure([("int4", METRICS)], {M.WEIGHTS_BYTES: 538e6}, {"int4": RESULTS})
    speed = fig.axes[2]
    assert [t.get_text() for t in speed.get_xticklabels()] == ["decode_b1", "decode_b16"]
    assert [t.get_text() for t in speed.texts] == ["FAIL"]


def test_run_note_says_the_decision_and_the_failing_figures():
    note = N.variant_note(EVALUATION, "int4", METRICS)
    first = note.splitlines()[0]
    assert first == "**int4: REFUSED: 2 gates failed**"
    assert note.splitlines()[2].startswith(  # the UI folds a description after a few lines: this one is above it
        "- `serve/min_decode_speedup/b16` **FAIL**: 0.935 (95 % CI 0.91 to 0.96) vs threshold 1")
    assert "`task/boolq/max_drop`" in note and "uninformative, reported" in note
    assert "`task/arc/max_drop`" not in note  # a clean pass is counted, not listed
    assert "measured on: Xeon, bfloat16" in note and "gates/release/gates_table.json" in note
    assert note.index("b16") < note.index("boolq")  # failures before what a person must judge


@pytest.mark.parametrize(("results", "decision", "aliases", "words"), [
    ([_gate("task/arc/max_drop", "pass", -0.05, -0.15)], "", (), "PASSED: every gate passed"),
    ([_gate("task/arc/max_drop", UNINFORMATIVE, -0.2, -0.15)], "approved by quantgate-auto", (),
     "APPROVED: gates passed, with 1 uninformative gate(s) a person must judge"),
    ([_gate("task/arc/max_drop", "pass", -0.05, -0.15)], "approved by ana", ("champion",), "PROMOTED"),
    ([_gate("task/arc/max_drop", UNINFORMATIVE, -0.2, -0.15, passed=False)], "", (), "NEEDS A PERSON"),
])
def test_headline_words_agree_with_the_verdicts(results, decision, aliases, words):
    note = N.variant_note(Evaluation("r", "release", results), "v", {}, decision, aliases)
    assert note.splitlines()[0].startswith(f"**v: {words}")
    assert ("@champion" in note) == bool(aliases)


def test_gate_table_lists_blocking_gates_first_with_their_ci():
    rows = N.table_rows(EVALUATION, METRICS)
    assert [r["gate"] for r in rows[:3]] == ["serve/min_decode_speedup/b16", "task/piqa/max_drop",
                                            "serve/min_prefill_speedup"]
    assert (rows[0]["ci_low"], rows[0]["ci_high"], rows[0]["blocks"]) == (0.91, 0.96, True)
    assert set(rows[0]) == set(N.TABLE_COLUMNS)


def test_auto_approval_names_the_gates_nobody_could_judge():
    from flows.approval import auto_decision

    clean = auto_decision(["int8"], {"int8": []})
    assert clean.comment == "auto-approved: every release gate passed" and clean.approved == {"int8": True}
    blind = auto_decision(["int8", "nf4"], {"int8": ["task/harmbench/max_drop", "safety/refusal_rate/max_fall"]})
    assert blind.approved == {"int8": True, "nf4": True}  # the rule is unchanged: only the words differ
    assert blind.comment.startswith("auto-approved: gates passed, with 2 uninformative gates a person must judge")
    assert "int8: task/harmbench/max_drop" in blind.comment


def test_storage_and_compute_dtypes_are_named_apart(tmp_path):
    import json

    class Client:  # what dtype_line reads: the variant's recorded quantgate.json
        def download_artifacts(self, run_id, path, dst):
            target = tmp_path / "quantgate.json"
            target.write_text(json.dumps({"options": {"dtype": "float32"},
                                          "weight_bytes_by_dtype": {"I8": 1, "F32": 2}}))
            return str(target)

    line = N.dtype_line(Client(), "r", "Xeon (amx), 2 threads, bfloat16 on cpu, kernel path x")
    assert line == ("- dtypes: weights stored as F32, I8 (the recipe's unquantized tensors: float32); "
                    "computed in bfloat16 (the serving engine's)")


def test_comparison_opens_with_a_narrow_decision_table_and_keeps_every_figure(store):
    from gates_fixtures import make_release

    from gates.records.comparison import FIRST_COLUMNS, comparison_markdown

    variant = {**METRICS, M.WEIGHTS_BYTES: 134.5e6, M.SERVE_DECODE_TPS: 9.5,
               M.speed_point("decode_b1", "rounds"): 6,
               M.decode_speedup(4): 1.2, M.ci(M.decode_speedup(4), "ci_low"): 1.1,
               M.ci(M.decode_speedup(4), "ci_high"): 1.3}
    runs = make_release("m-view", {"int4": variant}, register=False)
    text, _, _ = comparison_markdown(runs["release"][0], {runs["int4"][0]: EVALUATION})
    blocks = text.split("\n\n")
    first = blocks[2].splitlines()
    assert first[0] == "| " + " | ".join(FIRST_COLUMNS) + " |" and len(FIRST_COLUMNS) == 5
    assert first[2].startswith("| baseline | reference | 538 MB |")
    int4 = first[3]
    assert int4.startswith("| int4 | REFUSED: 2 gates failed | 0.25× (134.5 MB) | 2/7 |")
    assert int4.index("`serve/min_decode_speedup/b16` **FAIL** 0.935 [0.91, 0.96] vs 1") < int4.index("piqa")
    assert "`task/boolq/max_drop` **uninformative** -0.1 [-0.1, 0.1] vs -0.15" in int4
    assert "`task/cloze/max_drop` **pass, underpowered** -0.08" in int4
    assert "`task/arc/max_drop`" not in int4  # a clean pass is counted, not listed
    tables = {b: blocks[i + 1].splitlines()[2:] for i, b in enumerate(blocks) if b.startswith("## ")}
    tasks = tables["## Tasks: score (paired Δ vs baseline [95 % CI])"]
    assert "| piqa | 40 | — | 0.5 (-0.12 [-0.2, -0.04]) |" in tasks
    speed = [row.split(" | ")[0] for row in tables[next(k for k in tables if k.startswith("## Speed"))]]
    assert speed == ["| prefill", "| decode_b1", "| decode_b4", "| decode_b16"]  # by batch, not as text
    serving = tables["## Serving, size, capacity, safety"]
    assert "| weight MB (served) | 538 | 134.5 |" in serving
    assert "| decode tok/s (own run, unpaired) | 14 | 9.5 |" in serving
    assert "0.935 [0.91, 0.96], 8 rounds **FAIL** vs 1" in text
    assert "| prefill | 1 [0.7, 1.3] **uninformative, blocks** vs 0.8 |" in text


def test_batches_sort_as_numbers_in_the_gate_table_and_the_note():
    gates = [_gate(f"serve/min_decode_speedup/b{b}", "fail", 0.9, 1.0) for b in (16, 1, 4)]
    evaluation = Evaluation("r", "release", gates)
    assert [r["gate"] for r in N.table_rows(evaluation, {})] == [
        "serve/min_decode_speedup/b1", "serve/min_decode_speedup/b4", "serve/min_decode_speedup/b16"]
    note = N.variant_note(evaluation, "v", {})
    assert note.index("/b1`") < note.index("/b4`") < note.index("/b16`")
