"""`quantgate services up|down|status`: the team's services on loopback (see `quantgate.services`)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("services", help="PostgreSQL + Prefect server + MLflow server on loopback: up|down|status")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--pg-port", type=int, default=55432, help="PostgreSQL port (default 55432)")
    p.add_argument("--prefect-port", type=int, default=4200, help="Prefect server port (default 4200)")
    p.add_argument("--mlflow-port", type=int, default=5000, help="MLflow tracking server port (default 5000)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the servers to be healthy")
    p.add_argument("--json", action="store_true", help="status/up: print JSON")
    p.set_defaults(func=_services)


def _services(args: argparse.Namespace) -> int:
    from quantgate import services as S

    if args.action == "down":
        stopped = S.down()
        print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        return 0
    if args.action == "status":
        report = S.status()
        if args.json:
            print(json.dumps(report, indent=2))
        elif not report["running"]:
            print("services are not running (`quantgate services up`)")
        else:
            for name, row in report["services"].items():
                print(f"{name:9s} pid {row['pid']:>7}  {'healthy' if row['healthy'] else 'DOWN':8s} {row['url']}  log {row['log']}")
        return 0 if report["all_healthy"] else 1
    config = S.ServicesConfig(pg_port=args.pg_port, prefect_port=args.prefect_port, mlflow_port=args.mlflow_port,
                              start_timeout_s=args.timeout)
    try:
        services = S.up(config)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    if args.json:
        print(json.dumps({"prefect_url": services.prefect_url, "mlflow_url": services.mlflow_url, "env": services.env()}))
        return 0
    print(f"Prefect server  {services.prefect_url}   (UI and API; database on PostgreSQL 127.0.0.1:{services.pg_port})")
    print(f"MLflow server   {services.mlflow_url}   (runs and registry on PostgreSQL, artifacts served over HTTP)")
    # MLflow 3.17's UI opens experiments on the GenAI pages unless told the Model-training view in the URL
    print(f"MLflow UI       {services.mlflow_url}/#/experiments?workflowType=machine_learning   (the runs view)")
    print(f"state and logs  {services.root}")
    print("# export these in every shell that runs quantgate, a worker or the UI check:")
    print(services.env_lines())
    return 0
