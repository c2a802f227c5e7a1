"""The release's last word: one row per variant (gates, decision), the outcome, and where to look."""

from __future__ import annotations

from typing import Any

from quantgate.models import DEFAULT_MODEL, DEFAULT_MODEL_NOTE


def ui_command(tracking_uri: str) -> str:
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri}"
    return f"mlflow ui --backend-store-uri {tracking_uri}"


def _gates(row: dict[str, Any]) -> str:
    if row["gates_passed"] is None:
        return "—"
    blind = list(row.get("gates_uninformative", []))
    blocking = [g for g in blind if g in row["gates_failed"]]
    passed = row["gates_total"] - len(row["gates_failed"]) - (len(blind) - len(blocking))
    text = f"{passed}/{row['gates_total']} passed"
    return text + (f", {len(blind)} uninformative" if blind else "") + (f" ({len(blocking)} blocking)" if blocking else "")


def _stopped_by(row: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(real failures, blocking gates that could not have failed) of a row."""
    blind = set(row.get("gates_uninformative", []))
    return ([g for g in row["gates_failed"] if g not in blind], [g for g in row["gates_failed"] if g in blind])


def _stopped_text(row: dict[str, Any]) -> str:
    failed, blind = _stopped_by(row)
    parts = ([f"failed: {', '.join(failed)}"] if failed else []) + (
        [f"blocked as uninformative: {', '.join(blind)}"] if blind else [])
    return "; ".join(parts)


def _reasons(row: dict[str, Any]) -> list[tuple[str, str]]:
    """Each stopping gate with its recorded reason (a speed gate's ratio, CI and rounds)."""
    reasons = row.get("gates_reasons") or {}
    return [(g, reasons[g]) for g in row["gates_failed"] if g in reasons]


def _mb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e6:.1f}"


def render_table(summary: dict[str, Any]):
    from rich.table import Table

    table = Table(title=f"quantgate release of {summary['model']}", show_lines=False)
    for column in ("variant", "version", "weight MB", "gates", "decision", "MLflow run"):
        table.add_column(column, overflow="fold")
    for row in summary["rows"]:
        style = "green" if row["gates_passed"] else ("red" if row["gates_passed"] is False else "")
        table.add_row(row["name"], f"v{row['version']}" if row["version"] else "—", _mb(row["weight_bytes"]),
                      _gates(row), row["decision"], row["run_id"], style=style)
    return table


def print_summary(summary: dict[str, Any], console=None) -> None:
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=140)  # a log or a pipe: no reason to wrap run ids at 80 columns
    console.print(render_table(summary))
    for row in summary["rows"]:
        if row["gates_failed"]:
            console.print(f"[red]{row['name']}[/red] {_stopped_text(row)}")
            for gate, reason in _reasons(row):
                console.print(f"  {gate}: {reason}", markup=False)
    console.print(f"[bold]outcome:[/bold] {summary['outcome']}")
    if summary.get("model") == DEFAULT_MODEL:
        console.print(f"note: {DEFAULT_MODEL_NOTE}", markup=False)
    if summary.get("machine"):
        console.print(f"speeds measured on: {summary['machine']}", markup=False)
    if summary.get("canary"):
        c = summary["canary"]
        console.print("canary: " + ", ".join(f"{k}={_short(v)}" for k, v in c.items()))
    if summary.get("aliases"):
        console.print(f"aliases of {summary['registered_model']}: "
                      + ", ".join(f"{k} -> v{v}" for k, v in sorted(summary["aliases"].items())))
    console.print(f"release run {summary['release_run_id']} (Prefect flow run {summary['flow_run_id']})")
    console.print(f"see it: {ui_command(summary['tracking_uri'])}")


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _alias_text(data: dict[str, Any]) -> str:
    """`**@champion** → v3 (int8wo)`: which variant each alias now names."""
    names = {str(row["version"]): row["name"] for row in data["rows"] if row.get("version")}
    return ", ".join(f"**@{alias}** → v{v}" + (f" ({names[str(v)]})" if str(v) in names else "")
                     for alias, v in sorted(data["aliases"].items()))


def render_markdown(summary) -> str:
    data = summary if isinstance(summary, dict) else summary.as_dict()
    lines = [
        f"# Release of `{data['model']}`",
        "",
        f"- source sha256 `{data['source_hash'][:16]}`, Prefect flow run `{data['flow_run_id']}`",
        *([f"- note: {DEFAULT_MODEL_NOTE}"] if data.get("model") == DEFAULT_MODEL else []),
        f"- outcome: **{data['outcome']}**",
        *([f"- registry `{data.get('registered_model', '')}`: {_alias_text(data)}"] if data.get("aliases") else []),
        f"- speeds measured on: {data.get('machine') or 'not recorded'}"
        + (" (that dtype is what the engine computes in; what each variant stores is in its run's description)"
           if data.get("machine") else ""),
        "",
        "| variant | version | weight MB | gates | decision | run |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for row in data["rows"]:
        version = f"v{row['version']}" if row["version"] else "—"
        gates = _gates(row) + (f" ({_stopped_text(row)})" if row["gates_failed"] else "")
        lines.append(f"| {row['name']} | {version} | {_mb(row['weight_bytes'])} | {gates} | {row['decision']} "
                     f"| `{row['run_id']}` |")
    stops = [f"- {row['name']} `{g}`: {reason}" for row in data["rows"] for g, reason in _reasons(row)]
    if stops:
        lines += ["", "Why:", *stops]
    if data.get("canary"):
        lines += ["", "Canary: " + ", ".join(f"{k}={_short(v)}" for k, v in data["canary"].items())]
    lines += ["", f"Inspect: `{ui_command(data['tracking_uri'])}`"]
    return "\n".join(lines) + "\n"
