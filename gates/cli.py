"""Verbs: `gates show|evaluate|approve|history`, `promote`, `rollback`, `mlflow-ui`.

(`quantgate approve`, which also resumes a paused release flow, belongs to flows/; `gates approve` only
records the decision in MLflow.)
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    gates = subparsers.add_parser("gates", help="release gates recorded in MLflow: show, evaluate, approve, history")
    actions = gates.add_subparsers(dest="gates_action", metavar="<action>")
    gates.set_defaults(func=lambda args: gates.print_help())

    show = actions.add_parser("show", help="a table of a model's versions, or of one version's gates and verdicts")
    show.add_argument("--model", required=True, help="registered model (or source model) name")
    show.add_argument("--version", help="version to show gates for (default: list versions)")
    show.add_argument("--stage", default="release", choices=["release", "canary"])
    show.set_defaults(func=_show)

    evaluate = actions.add_parser("evaluate", help="judge a variant run's recorded metrics and record verdicts")
    evaluate.add_argument("--run-id", required=True)
    evaluate.add_argument("--policy", help="policy YAML (default: the packaged gates/policy.yaml)")
    evaluate.add_argument("--stage", default="release", choices=["release", "canary"])
    evaluate.set_defaults(func=_evaluate)

    approve = actions.add_parser("approve", help="record a release manager's decision on a version in MLflow")
    approve.add_argument("--model", required=True)
    approve.add_argument("--version", required=True)
    approve.add_argument("--by", required=True, help="who approves")
    approve.add_argument("--comment", default="")
    approve.add_argument("--reject", action="store_true", help="record a rejection instead")
    approve.set_defaults(func=_approve)

    history = actions.add_parser("history", help="every alias move of a model (time, who, reason)")
    history.add_argument("--model", required=True)
    history.set_defaults(func=_history)

    promote = subparsers.add_parser("promote", help="make a version the champion (gates passed and approved only)")
    promote.add_argument("--model", required=True)
    promote.add_argument("--version", required=True)
    promote.add_argument("--reason", default="")
    promote.add_argument("--by", default=None)
    promote.set_defaults(func=_promote)

    rollback = subparsers.add_parser("rollback", help="move champion back to the previous champion")
    rollback.add_argument("--model", required=True)
    rollback.add_argument("--reason", default="")
    rollback.add_argument("--by", default=None)
    rollback.set_defaults(func=_rollback)

    ui = subparsers.add_parser("mlflow-ui", help="print (and start) the MLflow UI over quantgate's store")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--print-only", action="store_true", help="print the command, do not start it")
    ui.set_defaults(func=_mlflow_ui)


def _console():
    from rich.console import Console

    return Console()


def _show(args: argparse.Namespace) -> int:
    from rich.table import Table

    from gates.judging.power import family_line, power_cell
    from gates.judging.verdicts import NOT_MEASURED, UNINFORMATIVE
    from gates.records.evaluation import read_evaluation
    from gates.records.registry import _version, read_approval, resolve_registered_model
    from gates.records.tracking import get_client

    client = get_client()
    name = resolve_registered_model(args.model, client)
    console = _console()
    aliases = {str(v): a for a, v in (client.get_registered_model(name).aliases or {}).items()}
    if args.version is None:
        table = Table(title=f"{name}: versions")
        for col in ("version", "alias", "variant", "method", "gates", "canary", "approval", "run"):
            table.add_column(col)
        versions = sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
        for mv in versions:
            approval = read_approval(name, mv.version)
            table.add_row(
                str(mv.version),
                aliases.get(str(mv.version), ""),
                mv.tags.get("variant", ""),
                mv.tags.get("method", ""),
                mv.tags.get("verdict", "pending"),
                mv.tags.get("canary_verdict", "—"),
                f"{approval.decision} by {approval.by}" if approval else "none",
                mv.run_id or "",
            )
        console.print(table)
        return 0
    mv = _version(client, name, args.version)
    evaluation = read_evaluation(mv.run_id, args.stage, client) if mv.run_id else None
    if evaluation is None:
        raise ValueError(f"{name} v{mv.version}: no {args.stage} gates recorded (run `quantgate gates evaluate`)")
    verdict = evaluation.extra.get("verdict", "?")
    table = Table(title=f"{name} v{mv.version} ({mv.tags.get('variant', '')}) {args.stage} gates: {verdict.upper()}")
    for col in ("gate", "rule", "threshold", "observed", "verdict", "reason", "power"):
        table.add_column(col, overflow="fold")
    for r in evaluation.results:
        observed = NOT_MEASURED if r.observed is None else f"{r.observed:.4g}"
        if r.verdict == UNINFORMATIVE:
            mark = "[bold yellow]UNINFORMATIVE (blocks)[/]" if not r.passed else "[yellow]uninformative[/]"
        else:
            mark = "[green]pass[/]" if r.passed else "[bold red]FAIL[/]"
        table.add_row(r.name, r.rule, f"{r.threshold:.4g}", observed, mark, r.reason, power_cell(r).replace("**", ""))
    console.print(table)
    console.print(family_line(evaluation.results).replace("`", ""), highlight=False)
    if evaluation.uninformative:
        console.print("uninformative (could not have failed at this baseline and sample size): "
                      + ", ".join(r.name for r in evaluation.uninformative))
    approval = read_approval(name, mv.version)
    console.print(
        f"evaluated {evaluation.evaluated_at} with {evaluation.policy_source}; run {mv.run_id}; "
        f"aliases: {aliases.get(str(mv.version), 'none')}; approval: "
        + (f"{approval.decision} by {approval.by} at {approval.at} ({approval.comment})" if approval else "none")
    )
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from gates.judging.verdicts import UNINFORMATIVE
    from gates.records.evaluation import evaluate_run

    evaluation = evaluate_run(args.run_id, args.policy, stage=args.stage)
    for r in evaluation.results:
        label = ("UNINF" if r.verdict == UNINFORMATIVE else "PASS") if r.passed else (
            "UNINF!" if r.verdict == UNINFORMATIVE else "FAIL")
        print(f"{label:6} {r.name}: {r.reason}")
    print(f"{args.stage} gates: {'PASS' if evaluation.passed else 'FAIL'} (recorded on run {args.run_id})")
    return 0 if evaluation.passed else 1


def _approve(args: argparse.Namespace) -> int:
    from gates.records.registry import record_approval

    approval = record_approval(args.model, args.version, by=args.by, comment=args.comment,
                               decision="rejected" if args.reject else "approved")
    print(f"{approval.decision} {args.model} v{args.version} by {approval.by} at {approval.at}")
    return 0


def _history(args: argparse.Namespace) -> int:
    from rich.table import Table

    from gates.records.registry import alias_history, resolve_registered_model

    name = resolve_registered_model(args.model)
    table = Table(title=f"{name}: alias moves")
    for col in ("#", "at", "alias", "move", "from", "to", "by", "reason"):
        table.add_column(col, overflow="fold")
    for m in alias_history(name):
        table.add_row(str(m.seq), m.at, m.alias, m.kind, m.previous or "—", m.version or "—", m.by, m.reason)
    _console().print(table)
    return 0


def _promote(args: argparse.Namespace) -> int:
    from gates.records.registry import promote

    move = promote(args.model, args.version, reason=args.reason, by=args.by)
    print(f"champion: v{move.previous or '—'} -> v{move.version} ({move.reason})")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from gates.records.registry import rollback

    move = rollback(args.model, reason=args.reason, by=args.by)
    print(f"champion: v{move.previous} -> v{move.version} (rolled back: {move.reason})")
    return 0


def _mlflow_ui(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    from gates.records.tracking import is_local_store, tracking_uri, ui_command, ui_env

    uri = tracking_uri()
    if not is_local_store(uri):
        print(f"MLflow tracking server: {uri} (open it in a browser)")
        return 0
    command = ui_command(host=args.host, port=args.port)
    print(shlex.join(["mlflow", *command[3:]]))
    if args.print_only:
        return 0
    print(f"starting; open http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    process = subprocess.Popen(command, env=ui_env())
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.terminate()
        process.wait(timeout=30)
        return 130
