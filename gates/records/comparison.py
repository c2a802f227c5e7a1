"""A release's variants side by side, read back from MLflow and logged on the release (parent) run as
`comparison/comparison.md` and `comparison/comparison.png`; each run then gets its lineage
(`gates.records.lineage`: the flips table, the eval datasets as inputs).

`comparison.md` opens with one narrow table a release manager reads on one screen: each variant's verdict,
its weight size against the baseline's, and the gates that decided it (failed, uninformative, underpowered)
with their figures and CIs. Below it, one table per family (tasks, paired speed, serving and size), each with
a row per task / operating point / metric and a column per model, so its width grows with the variants, not
with the tasks."""

from __future__ import annotations

import re

from gates import metric_names as M
from gates.judging.verdicts import UNINFORMATIVE, Evaluation, GateResult
from gates.records.run_notes import by_attention, gate_ci, headline, is_clean_pass, natural_key
from gates.records.tracking import (
    BASELINE,
    TAG_KIND,
    TAG_ROLE,
    TAG_VARIANT,
    get_client,
    get_run,
    release_children,
)

# The serving / size / capacity / safety rows: (metric, label, scale).
_SERVING = (
    (M.WEIGHTS_BYTES, "weight MB (served)", 1e-6),
    (M.SERVE_DECODE_TPS, "decode tok/s (own run, unpaired)", 1.0),
    (M.SERVE_PREFILL_TPS, "prefill tok/s (own run, unpaired)", 1.0),
    (M.SERVE_TPOT_P99_S, "p99 TPOT s", 1.0),
    (M.SERVE_TTFT_P99_S, "p99 TTFT s", 1.0),
    (M.CAPACITY_MAX_SEQS, "max seqs", 1.0),
    (M.SAFETY_REFUSAL_RATE, "refusal rate", 1.0),
    (M.SAFETY_OVER_REFUSAL_RATE, "over-refusal rate", 1.0),
)
FIRST_COLUMNS = ("variant", "verdict", "weights vs baseline", "gates passed cleanly",
                 "deciding gates: figure [95 % CI] vs threshold")
_SPEED_KEY = re.compile(r"^serve/(decode|long_decode)_speedup_b(\d+)$")


def _num(value: float | None, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value * scale:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * len(header)) + " |",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _name(run) -> str:
    return run.data.tags.get(TAG_VARIANT, run.info.run_name)


def _label(r: GateResult) -> str:
    blind = r.verdict == UNINFORMATIVE
    return ("FAIL" if r.verdict == "fail" else "uninformative, blocks" if blind and not r.passed
            else "uninformative" if blind else "pass, underpowered" if r.underpowered else r.verdict)


def _gate_figure(r: GateResult, metrics: dict[str, float]) -> str:
    """`serve/min_decode_speedup/b16` FAIL 0.935 [0.91, 0.96] vs 1."""
    label = _label(r)
    ci = gate_ci(r.name, metrics)
    ci_text = f" [{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""
    return f"`{r.name}` **{label}** {_num(r.observed)}{ci_text} vs {r.threshold:.4g}"


def _first_row(run, evaluation: Evaluation | None, base_bytes: float | None) -> list[str]:
    m = run.data.metrics
    size = m.get(M.WEIGHTS_BYTES)
    ratio = f"{size / base_bytes:.3g}× ({size * 1e-6:.4g} MB)" if size and base_bytes else f"{_num(size, 1e-6)} MB"
    if evaluation is None:
        verdict = run.data.tags.get(M.stage_tag("release", "verdict"), "not judged")
        return [_name(run), verdict, ratio, "—", "—"]
    notable = [r for r in by_attention(evaluation) if not is_clean_pass(r)]
    clean = sum(is_clean_pass(r) for r in evaluation.results)
    deciding = "; ".join(_gate_figure(r, m) for r in notable) or "none: every gate passed cleanly"
    return [_name(run), headline(evaluation), ratio, f"{clean}/{len(evaluation.results)}", deciding]


def _task_rows(rows: list, tasks: list[str]) -> list[list[str]]:
    out = []
    for t in tasks:
        n_key = M.task_key(t, "n")
        ns = sorted({int(r.data.metrics[n_key]) for r in rows if n_key in r.data.metrics})
        cells = [t, "/".join(map(str, ns)) or "—"]
        for run in rows:
            m = run.data.metrics
            text = _num(m.get(M.task_score(t)))
            if M.task_delta(t) in m:
                text += (f" ({m[M.task_delta(t)]:+.3g} [{_num(m.get(M.task_delta_ci_low(t)))}, "
                         f"{_num(m.get(M.task_delta_ci_high(t)))}])")
            cells.append(text)
        out.append(cells)
    return out


def speed_points(metrics_list: list[dict[str, float]]) -> list[tuple[str, str, str]]:
    """(point, ratio metric, gate) for every paired ratio recorded: prefill, then decode, then long-context
    decode, each by batch in numeric order (b1, b4, b16: the metric names sort as text, b1, b16, b4)."""
    points = {}
    for metrics in metrics_list:
        if M.SERVE_PREFILL_SPEEDUP in metrics:
            points["prefill"] = (M.SERVE_PREFILL_SPEEDUP, "serve/min_prefill_speedup")
        for key in metrics:
            if match := _SPEED_KEY.match(key):
                kind, batch = match.groups()
                gate = f"serve/min_decode_speedup/{'long_' if kind == 'long_decode' else ''}b{batch}"
                points[f"{kind}_b{batch}"] = (key, gate)
    family = lambda p: 0 if p == "prefill" else 2 if p.startswith("long") else 1  # noqa: E731
    order = sorted(points, key=lambda p: (family(p), natural_key(p)))
    return [(p, *points[p]) for p in order]


def _speed_rows(variants: list, evaluations: dict[str, Evaluation | None]) -> list[list[str]]:
    out = []
    for point, key, gate in speed_points([r.data.metrics for r in variants]):
        cells = [point]
        for run in variants:
            m = run.data.metrics
            if key not in m:
                cells.append("—")
                continue
            low, high = m.get(M.ci(key, "ci_low")), m.get(M.ci(key, "ci_high"))
            text = f"{m[key]:.4g}"
            text += f" [{low:.4g}, {high:.4g}]" if low is not None and high is not None else ""
            rounds = m.get(M.speed_point(point, "rounds"))
            text += f", {rounds:.0f} rounds" if rounds is not None else ""
            evaluation = evaluations.get(run.info.run_id)
            result = next((r for r in evaluation.results if r.name == gate), None) if evaluation else None
            if result is not None:
                text += f" **{_label(result)}** vs {result.threshold:.4g}"
            cells.append(text)
        out.append(cells)
    return out


def comparison_markdown(release_run_id: str, evaluations: dict[str, Evaluation | None] | None = None
                        ) -> tuple[str, list, dict]:
    """The Markdown, the variant runs and the baseline's metrics; `evaluations` (run id → its release gates,
    None when never judged) is read from MLflow where not given."""
    client = get_client()
    children = release_children(release_run_id, client)
    baseline = next((r for r in children if r.data.tags.get(TAG_ROLE) == BASELINE), None)
    variants = [r for r in children if r.data.tags.get(TAG_ROLE) != BASELINE]
    if evaluations is None:
        evaluations = {r.info.run_id: _evaluation(r.info.run_id, client) for r in variants}
    rows = ([baseline] if baseline else []) + variants
    base_bytes = baseline.data.metrics.get(M.WEIGHTS_BYTES) if baseline else None
    first = [[_name(baseline), "reference", _num(base_bytes, 1e-6) + " MB", "—", "—"]] if baseline else []
    first += [_first_row(r, evaluations.get(r.info.run_id), base_bytes) for r in variants]
    lines = [f"# Release `{release_run_id}`: variants side by side", "",
             "Each variant's verdict on its release gates and the gates that decided it (every gate: the "
             "variant run's `gates/release/gates.md`); the tables below give every figure. — means not "
             "measured.", "",
             *_table(list(FIRST_COLUMNS), first)]
    names = [_name(r) for r in rows]
    tasks = sorted(set().union(*(M.tasks_in(r.data.metrics) for r in rows)), key=natural_key) if rows else []
    if tasks:
        lines += ["## Tasks: score (paired Δ vs baseline [95 % CI])", "",
                  *_table(["task", "n", *names], _task_rows(rows, tasks))]
    speed = _speed_rows(variants, evaluations)
    if speed:
        lines += ["## Speed: paired ratio variant / baseline tok/s [95 % CI], rounds to its stop, verdict",
                  "",
                  *_table(["operating point", *[_name(r) for r in variants]], speed)]
    serving = [[label, *(_num(r.data.metrics.get(key), scale) for r in rows)]
               for key, label, scale in _SERVING]
    lines += ["## Serving, size, capacity, safety", "", *_table(["metric", *names], serving)]
    return "\n".join(lines), variants, (baseline.data.metrics if baseline else {})


def _evaluation(run_id: str, client) -> Evaluation | None:
    """A variant's release gates (None when it was never judged)."""
    from gates.records.evaluation import read_evaluation

    return read_evaluation(run_id, "release", client)


def log_release_comparison(release_run_id: str) -> str:
    """Write the side-by-side table and figure onto the release run; returns the Markdown."""
    from gates.records.release_plots import comparison_figure

    client = get_client()
    if get_run(release_run_id, client).data.tags.get(TAG_KIND) != "release":
        raise ValueError(f"run {release_run_id} is not a quantgate release run")
    runs = release_children(release_run_id, client)
    evaluations = {r.info.run_id: _evaluation(r.info.run_id, client) for r in runs
                   if r.data.tags.get(TAG_ROLE) != BASELINE}
    text, variants, baseline = comparison_markdown(release_run_id, evaluations)
    client.log_text(release_run_id, text, "comparison/comparison.md")
    named = [(_name(r), r.data.metrics) for r in variants]
    verdicts = {_name(r): (evaluations[r.info.run_id].results if evaluations[r.info.run_id] else [])
                for r in variants}
    figure = comparison_figure(named, baseline, verdicts)
    client.log_figure(release_run_id, figure, "comparison/comparison.png")
    from gates.records.lineage import log_release_lineage

    log_release_lineage(client, release_children(release_run_id, client))  # flips tables, dataset inputs
    return text
