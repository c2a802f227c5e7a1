"""A stage's gate report as Markdown (`gates/<stage>/gates.md` on the run, the release summary, the CLI)."""

from __future__ import annotations

from gates.judging import power as P
from gates.judging.verdicts import NOT_MEASURED, UNINFORMATIVE, Evaluation, GateResult


def render_markdown(evaluation: Evaluation, title: str) -> str:
    verdict = "PASS" if evaluation.passed else "FAIL"
    lines = [
        f"# Gates ({evaluation.stage}): {title} — {verdict}",
        "",
        f"- run: `{evaluation.run_id}`; baseline run: `{evaluation.baseline_run_id or 'none'}`",
        f"- policy: `{evaluation.policy_source}` (sha256 `{evaluation.policy_sha256[:12]}`)",
        f"- evaluated at {evaluation.evaluated_at}; a metric that was not recorded fails its gate",
        f"- {_uninformative_line(evaluation)}",
        f"- measured on: {evaluation.extra.get('machine') or 'not recorded'}",
        f"- {P.family_line(evaluation.results)}",
        "",
        *_attention(evaluation),
        "| gate | rule | threshold | observed | verdict | reason | power |",
        "| --- | --- | ---: | ---: | --- | --- | --- |",
    ]
    for r in evaluation.results:
        observed = NOT_MEASURED if r.observed is None else f"{r.observed:.4g}"
        lines.append(f"| `{r.name}` | {r.rule} | {r.threshold:.4g} | {observed} | {verdict_label(r)} | {r.reason} | {P.power_cell(r)} |")
    if not evaluation.results:
        lines.append("| (no gates configured for this stage) | | | | pass | | |")
    return "\n".join(lines) + "\n"


def verdict_label(r: GateResult) -> str:
    if r.verdict == UNINFORMATIVE:
        return "**UNINFORMATIVE** (blocks)" if not r.passed else "uninformative (reported)"
    return "pass" if r.passed else "**FAIL**"


def _uninformative_line(evaluation: Evaluation) -> str:
    names = [f"`{r.name}`" for r in evaluation.uninformative]
    if not names:
        return "every gate could have failed at this baseline and sample size"
    return (f"uninformative (could not have failed at this baseline and sample size; a person must judge "
            f"them): {', '.join(names)}")


def _attention(evaluation: Evaluation) -> list[str]:
    """What stopped the variant, above the full table (the MLflow viewer shows a report in a fixed box: the
    one FAIL row of a long table was below its fold)."""
    stopping = [r for r in evaluation.results if not r.passed]
    if not stopping:
        return []
    lines = ["**Stopped by:**", ""]
    for r in stopping:
        observed = NOT_MEASURED if r.observed is None else f"{r.observed:.4g}"
        lines.append(f"- `{r.name}` {verdict_label(r)}: observed {observed}, threshold {r.threshold:.4g} — {r.reason}")
    return [*lines, ""]
