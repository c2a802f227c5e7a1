"""A release's variants side by side, read back from MLflow and logged on the release (parent) run as
`comparison/comparison.md` and `comparison/comparison.png`; each run then gets its lineage
(`gates.records.lineage`: the flips table, the eval datasets as inputs)."""

from __future__ import annotations

from gates import metric_names as M
from gates.records.tracking import (
    BASELINE,
    TAG_KIND,
    TAG_ROLE,
    TAG_VARIANT,
    get_client,
    get_run,
    release_children,
)

_COLUMNS = (
    (M.WEIGHTS_BYTES, "weight MB", 1e-6),
    (M.SERVE_DECODE_TPS, "decode tok/s", 1.0),
    (M.SERVE_PREFILL_TPS, "prefill tok/s", 1.0),
    (M.SERVE_TPOT_P99_S, "p99 TPOT s", 1.0),
    (M.SERVE_TTFT_P99_S, "p99 TTFT s", 1.0),
    (M.CAPACITY_MAX_SEQS, "max seqs", 1.0),
    (M.SAFETY_REFUSAL_RATE, "refusal", 1.0),
    (M.SAFETY_OVER_REFUSAL_RATE, "over-refusal", 1.0),
)


def comparison_markdown(release_run_id: str) -> tuple[str, list, dict]:
    client = get_client()
    children = release_children(release_run_id, client)
    baseline = next((r for r in children if r.data.tags.get(TAG_ROLE) == BASELINE), None)
    variants = [r for r in children if r.data.tags.get(TAG_ROLE) != BASELINE]
    rows = ([baseline] if baseline else []) + variants
    tasks = sorted(set().union(*(M.tasks_in(r.data.metrics) for r in rows)) if rows else set())

    def cell(value: float | None, scale: float = 1.0) -> str:
        return "—" if value is None else f"{value * scale:.4g}"

    header = ["variant", "gates"] + [f"{t} score (Δ [CI])" for t in tasks] + [label for _, label, _ in _COLUMNS]
    lines = [
        f"# Release `{release_run_id}`: variants side by side",
        "",
        "Δ is the paired delta against the baseline with its bootstrap CI; — means not measured.",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(["---"] * len(header)) + " |",
    ]
    for run in rows:
        m = run.data.metrics
        cells = [run.data.tags.get(TAG_VARIANT, run.info.run_name), run.data.tags.get(M.stage_tag("release", "verdict"), "—")]
        for t in tasks:
            text = cell(m.get(M.task_score(t)))
            if M.task_delta(t) in m:
                text += f" ({m[M.task_delta(t)]:+.3g} [{cell(m.get(M.task_delta_ci_low(t)), 1)}, {cell(m.get(M.task_delta_ci_high(t)), 1)}])"
            cells.append(text)
        cells += [cell(m.get(key), scale) for key, _, scale in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", variants, (baseline.data.metrics if baseline else {})


def _results(run_id: str, client) -> list:
    """A variant's release gates, for the figure's colours (none when it was never judged)."""
    from gates.records.evaluation import read_evaluation

    evaluation = read_evaluation(run_id, "release", client)
    return evaluation.results if evaluation else []


def log_release_comparison(release_run_id: str) -> str:
    """Write the side-by-side table and figure onto the release run; returns the Markdown."""
    from gates.records.release_plots import comparison_figure

    client = get_client()
    if get_run(release_run_id, client).data.tags.get(TAG_KIND) != "release":
        raise ValueError(f"run {release_run_id} is not a quantgate release run")
    text, variants, baseline = comparison_markdown(release_run_id)
    client.log_text(release_run_id, text, "comparison/comparison.md")
    named = [(r.data.tags.get(TAG_VARIANT, r.info.run_name), r.data.metrics) for r in variants]
    verdicts = {name: _results(r.info.run_id, client) for (name, _), r in zip(named, variants, strict=True)}
    client.log_figure(release_run_id, comparison_figure(named, baseline, verdicts), "comparison/comparison.png")
    from gates.records.lineage import log_release_lineage

    log_release_lineage(client, release_children(release_run_id, client))  # flips tables, dataset inputs
    return text
