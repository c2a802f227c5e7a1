"""What a release manager reads first in the MLflow UI: each run's description (the run note, the
`mlflow.note.content` tag the UI shows on a run's Overview) says the decision and why, and each stage's gates
are one sortable table artifact (`gates/<stage>/gates_table.json`) instead of a tag per gate field.

The note of a variant run: its headline (promoted / refused / needs a person / passed), the gates that
stopped it or that nobody could judge from the data (figure, CI, threshold), the machine its speeds were
measured on, and where the evidence is. The release run's note is the release table (flows.summary)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from gates import metric_names as M
from gates.judging.verdicts import NOT_MEASURED, UNINFORMATIVE, Evaluation, GateResult

if TYPE_CHECKING:
    from mlflow import MlflowClient

NOTE_TAG = "mlflow.note.content"  # what the MLflow UI shows as a run's description
GATES_TABLE = "gates_table.json"
TABLE_COLUMNS = ("gate", "verdict", "blocks", "observed", "ci_low", "ci_high", "threshold", "rule", "reason",
                 "harmless_pass", "underpowered")
_DIGITS = re.compile(r"(\d+)")
_NOTE_MAX = 20000  # a tag value may be long, but a description is read on one screen


def metric_of(gate: str) -> str | None:
    """The metric whose CI a gate judges (task deltas, speed ratios); None for point gates."""
    parts = gate.split("/")
    if parts[0] == "task" and len(parts) == 3:
        return M.task_delta(parts[1])
    if gate.startswith("serve/min_decode_speedup/long_b"):
        return M.long_decode_speedup(int(gate.rsplit("long_b", 1)[1]))
    if gate.startswith("serve/min_decode_speedup/b"):
        return M.decode_speedup(int(gate.rsplit("/b", 1)[1]))
    return {"serve/min_prefill_speedup": M.SERVE_PREFILL_SPEEDUP,
            "canary/min_tpot_speedup": M.CANARY_TPOT_SPEEDUP}.get(gate)


def gate_ci(gate: str, metrics: dict[str, float]) -> tuple[float, float] | None:
    """The CI bounds the gate judged, where the run recorded them."""
    key = metric_of(gate)
    if key is None:
        return None
    if key.startswith("task/"):
        task = key.split("/")[1]
        low, high = M.task_delta_ci_low(task), M.task_delta_ci_high(task)
    else:
        low, high = M.ci(key, "ci_low"), M.ci(key, "ci_high")
    return (metrics[low], metrics[high]) if low in metrics and high in metrics else None


def natural_key(name: str) -> tuple:
    """Sort key with the numbers in a name compared as numbers: `.../b1`, `.../b4`, `.../b16` (MLflow sorts
    the metric names `serve/decode_speedup_b1|b16|b4` as text; the names stay: the judge and verify read
    them)."""
    return tuple(int(part) if part.isdigit() else part for part in _DIGITS.split(name))


def is_clean_pass(r: GateResult) -> bool:
    """A gate nobody needs to look at: passed, informative, powered."""
    return r.verdict == "pass" and r.passed and not r.underpowered


def by_attention(evaluation: Evaluation) -> list[GateResult]:
    """Failures first, then blocking uninformative, reported uninformative, underpowered, clean passes; by
    name within each, batches in numeric order."""
    def rank(r: GateResult) -> int:
        if r.verdict == UNINFORMATIVE:
            return 2 if r.passed else 1
        return 0 if not r.passed else 3 if r.underpowered else 4

    return sorted(evaluation.results, key=lambda r: (rank(r), natural_key(r.name)))


def table_rows(evaluation: Evaluation, metrics: dict[str, float]) -> list[dict]:
    """One row per gate, the gates a person must look at first (failures, then uninformative)."""
    rows = []
    for r in by_attention(evaluation):
        ci = gate_ci(r.name, metrics)
        rows.append({"gate": r.name, "verdict": r.verdict, "blocks": not r.passed, "observed": r.observed,
                     "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None,
                     "threshold": r.threshold, "rule": r.rule, "reason": r.reason,
                     "harmless_pass": r.harmless_pass, "underpowered": r.underpowered})
    return rows


def log_gate_table(client: MlflowClient, run_id: str, evaluation: Evaluation, metrics: dict[str, float]) -> None:
    """The stage's gates as a table the MLflow UI renders (Artifacts tab, and Evaluation's table view)."""
    rows = table_rows(evaluation, metrics)
    client.log_table(run_id, {c: [row[c] for row in rows] for c in TABLE_COLUMNS},
                     f"gates/{evaluation.stage}/{GATES_TABLE}")


def _fig(value: float | None) -> str:
    return NOT_MEASURED if value is None else f"{value:.4g}"


def gate_line(r: GateResult, metrics: dict[str, float]) -> str:
    """`serve/min_decode_speedup/b16` FAIL: 0.935 (95 % CI 0.91 to 0.96) vs threshold 1 — reason."""
    ci = gate_ci(r.name, metrics)
    ci_text = f" (95 % CI {ci[0]:.4g} to {ci[1]:.4g})" if ci else ""
    label = ("FAIL" if r.verdict == "fail" else "UNINFORMATIVE, blocks" if r.verdict == UNINFORMATIVE and not r.passed
             else "uninformative, reported" if r.verdict == UNINFORMATIVE else "pass, underpowered")
    return f"- `{r.name}` **{label}**: {_fig(r.observed)}{ci_text} vs threshold {r.threshold:.4g} — {r.reason}"


def headline(evaluation: Evaluation, decision: str = "", aliases: tuple[str, ...] = ()) -> str:
    """PROMOTED / REFUSED / NEEDS A PERSON / PASSED, in words that agree with the gates."""
    failed = [r for r in evaluation.failed if r.verdict != UNINFORMATIVE]
    blind = evaluation.uninformative
    if failed:
        return f"REFUSED: {len(failed)} gate{'s' if len(failed) > 1 else ''} failed"
    if not evaluation.passed:
        return f"NEEDS A PERSON: blocked only by {len(evaluation.failed)} uninformative gate(s)"
    verb = "PROMOTED" if "champion" in aliases else "APPROVED" if decision.startswith("approved") else "PASSED"
    if blind:
        return f"{verb}: gates passed, with {len(blind)} uninformative gate(s) a person must judge"
    return f"{verb}: every gate passed"


def variant_note(evaluation: Evaluation, name: str, metrics: dict[str, float], decision: str = "",
                 aliases: tuple[str, ...] = (), dtypes: str | None = None) -> str:
    """The run's description: the decision, the gates behind it with their figures, the machine, the evidence."""
    stage = evaluation.stage
    # The UI folds a description after a few lines: the headline and the stopping gates come first.
    lines = [f"**{name}: {headline(evaluation, decision, aliases)}**", ""]
    notable = [r for r in by_attention(evaluation) if not is_clean_pass(r)]
    lines += [gate_line(r, metrics) for r in notable]
    if aliases:
        lines.append(f"- registry alias: **{', '.join(f'@{a}' for a in aliases)}**")
    if decision:
        lines.append(f"- decision: {decision}")
    total, clean = len(evaluation.results), sum(is_clean_pass(r) for r in evaluation.results)
    lines.append(f"- {stage} gates: {clean}/{total} passed cleanly" + (", the others above" if notable else ""))
    lines += ["", f"- measured on: {evaluation.extra.get('machine') or 'not recorded'}", *([dtypes] if dtypes else []),
              f"- evidence: Artifacts → `gates/{stage}/gates.md` (every gate), `gates/{stage}/{GATES_TABLE}` "
              f"(sortable), `gates/{stage}/task_deltas.png`, `gates/{stage}/speed.png`; policy sha256 "
              f"`{evaluation.policy_sha256[:12]}`"]
    note = "\n".join(lines) + "\n"
    return note if len(note) <= _NOTE_MAX else note[: _NOTE_MAX - 40] + "\n… (see gates.md)\n"


def baseline_note(name: str, machine: str, decision: str = "", aliases: tuple[str, ...] = ()) -> str:
    lines = [f"**{name}: REFERENCE**", "",
             "- the baseline every variant of this release is judged against (it has no gates of its own)"]
    if aliases:
        lines.append(f"- registry alias: **{', '.join(f'@{a}' for a in aliases)}**")
    if decision:
        lines.append(f"- decision: {decision}")
    lines.append(f"- measured on: {machine or 'not recorded'}")
    return "\n".join(lines) + "\n"


_COMPUTE_RE = re.compile(r"\b(float32|bfloat16|float16|float64)\b on ")


def dtype_line(client: MlflowClient, run_id: str, machine: str) -> str | None:
    """Storage and compute dtypes named apart: the recipe's `dtype` is what the unquantized tensors are stored
    in (and what the tables by dtype count); the machine line's dtype is what the engine computes in."""
    manifest = _variant_manifest(client, run_id)
    storage = ((manifest or {}).get("options") or {}).get("dtype")
    by_dtype = ", ".join(sorted((manifest or {}).get("weight_bytes_by_dtype") or {}))
    compute = _COMPUTE_RE.search(machine or "")
    if not storage and not compute:
        return None
    stored = f"weights stored as {by_dtype or '?'} (the recipe's unquantized tensors: {storage or '?'})"
    return f"- dtypes: {stored}; computed in {compute.group(1) if compute else '?'} (the serving engine's)"


def _variant_manifest(client: MlflowClient, run_id: str) -> dict | None:
    import tempfile

    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory(prefix="quantgate-note-") as tmp:
        try:
            path = client.download_artifacts(run_id, "variant/quantgate.json", tmp)
        except (MlflowException, OSError):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def set_note(client: MlflowClient, run_id: str, text: str) -> None:
    client.set_tag(run_id, NOTE_TAG, text)
