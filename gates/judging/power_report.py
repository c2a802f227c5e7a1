"""Power figures on gate results and in reports: attached to results (verdicts unchanged), written to and read
back from MLflow tags, the report's cell and family line, and the flip rates a recorded run's comparison gives."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from gates.judging.power_gates import REFUSAL_POWER, GatePower, flip_rates


def with_power(results: list, powers: Mapping[str, GatePower]) -> list:
    """Task gate results (gates.records.evaluation.GateResult) with their power figures; verdicts unchanged."""
    out = []
    for r in results:
        task = r.name[len("task/"):-len("/max_drop")] if r.name.startswith("task/") else None
        p = powers.get(task) if task else None
        out.append(r if p is None else replace(r, harmless_pass=p.harmless_pass, refusal80_drop=p.refusal80_drop,
                                               underpowered=p.underpowered))
    return out


def with_gate_power(results: list, powers: Mapping[str, GatePower]) -> list:
    """Gate results (any family) with the power figure recorded under their gate name; verdicts unchanged."""
    return [r if (p := powers.get(r.name)) is None else
            replace(r, harmless_pass=p.harmless_pass, refusal80_drop=p.refusal80_drop, underpowered=p.underpowered)
            for r in results]


def recorded_flip_rates(client, run_id: str) -> dict[str, float]:
    """Flip rates from the variant run's `evidence/compare.json` ({} when it has none)."""
    import json
    import tempfile

    from mlflow.exceptions import MlflowException

    from gates.metric_names import EVIDENCE_DIR

    with tempfile.TemporaryDirectory(prefix="quantgate-power-") as tmp:
        try:
            path = client.download_artifacts(run_id, f"{EVIDENCE_DIR}/compare.json", tmp)
            return flip_rates(json.loads(Path(path).read_text()))
        except (MlflowException, OSError, ValueError, KeyError):  # recorded without its comparison
            return {}


POWER_FIELDS = ("harmless_pass", "refusal80_drop", "underpowered")


def power_tags(result) -> dict[str, str]:
    """A gate result's power figures as `gate/<name>/<field>` tag values (none for gates without them)."""
    if result.harmless_pass is None:
        return {}
    return {"harmless_pass": repr(result.harmless_pass), "refusal80_drop": repr(result.refusal80_drop),
            "underpowered": "true" if result.underpowered else "false"}


def power_from_tags(tags: Mapping[str, str], key) -> dict:
    """The GateResult fields `power_tags` wrote, read back (`key(field)` names the tag)."""
    if key("harmless_pass") not in tags:
        return {}
    return {"harmless_pass": float(tags[key("harmless_pass")]), "refusal80_drop": float(tags[key("refusal80_drop")]),
            "underpowered": tags.get(key("underpowered")) == "true"}


def power_cell(result) -> str:
    if result.harmless_pass is None:
        return "—"
    label = " **underpowered**" if result.underpowered else ""
    refused = result.refusal80_drop
    return f"{result.harmless_pass:.2f} / {'—' if refused is None or math.isnan(refused) else f'{refused:.3g}'}{label}"


def family_line(results: Sequence) -> str:
    """The report's line on power: the family's harmless-pass probability and the underpowered gates."""
    gates = [r for r in results if r.harmless_pass is not None]
    if not gates:
        return "power: no gate with a recorded n"
    weak = [f"`{r.name}`" for r in gates if r.underpowered]
    line = (f"power (column: P(pass) / the effect refused with {REFUSAL_POWER:.0%} probability; tasks, safety, "
            f"long context: a variant equal to the baseline; fidelity, speed: at the measured effect, docs/gates.md "
            f"\"Power\"): all {len(gates)} gates with a figure pass together with probability "
            f"{math.prod(r.harmless_pass for r in gates):.3f} (gates independent)")
    return line + (f"; underpowered (reported, never blocks): {', '.join(weak)}" if weak else "")


def family_metric(results: Sequence, key: str) -> dict[str, float]:
    gates = [r.harmless_pass for r in results if r.harmless_pass is not None]
    return {key: math.prod(gates)} if gates else {}
