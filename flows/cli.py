"""Flow verbs: `quantgate release | tune | approve | deploy | watch | notify | demo` (tune: flows/tune_cli.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The CLI is where Prefect's environment is set (importing flows/ sets nothing): each verb that imports Prefect
# calls prepare() first. Those imports stay inside the verbs: `quantgate --help` imports this module, and
# Prefect, MLflow and torch take seconds each.
from flows.data import DEFAULT_SUITES
from flows.runtime import prepare

DEMO_LIMIT = 40  # items per task in `make demo`: enough for the gates to tell int8 from noise, ~6 min on 2 cores
DEMO_POLICY = Path(__file__).with_name("demo_policy.yaml")  # the default gates, sized for 40 items a task
DEMO_SUITES = "accuracy,safety,arc_easy,piqa,hellaswag,winogrande"  # our own tasks beside four real benchmarks


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("release", help="run the release flow: quantize, measure, gate, approve, canary, promote")
    _release_args(p)
    _plan_args(p)
    p.set_defaults(func=_release)

    from flows.tune_cli import add_parser as add_tune_parser

    add_tune_parser(subparsers).set_defaults(func=_tune)

    p = subparsers.add_parser("demo", help="the whole release on the embedded default model, auto-approved")
    p.add_argument("--limit", type=int, default=DEMO_LIMIT, help=f"items per eval task (default {DEMO_LIMIT})")
    _methods_arg(p)
    p.add_argument("--policy", default=str(DEMO_POLICY), help="gate policy (default flows/demo_policy.yaml)")
    p.add_argument("--suites", default=DEMO_SUITES, help=f"eval suites and/or task names (default {DEMO_SUITES})")
    p.add_argument("--verbose", action="store_true", help="show Prefect's run logs in the terminal too")
    _ray_arg(p)
    p.set_defaults(func=_demo)

    p = subparsers.add_parser("approve", help="approve (or --reject) a release paused for approval")
    p.add_argument("run_id", nargs="?", help="the Prefect flow run id printed when the release paused")
    p.add_argument("--reject", action="store_true", help="reject instead of approve")
    p.add_argument("--comment", "-m", default="", help="why (recorded in MLflow with who and when)")
    p.add_argument("--by", default=None, help="who decides (default: $QUANTGATE_USER or the login name)")
    p.add_argument("--variant", action="append", default=[], help="decide on this variant only (repeatable)")
    p.add_argument("--list", action="store_true", help="list the releases waiting for a decision")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the release to finish")
    p.set_defaults(func=_approve)

    p = subparsers.add_parser("deploy", help="serve the release flow as a Prefect deployment triggered on model change")
    p.add_argument("--name", default=None, help="deployment name (default on-model-change)")
    p.add_argument("--work-pool", default=None, metavar="POOL",
                   help="register on this process work pool of the Prefect server (PREFECT_API_URL) and exit; "
                        "`prefect worker start --pool POOL` runs the releases")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="each triggered release runs its per-model work on this Ray cluster (host:port or auto), "
                        "as `quantgate release --ray-address` does")
    p.set_defaults(func=_deploy)

    p = subparsers.add_parser("watch", help="watch model dirs / .gguf files and emit quantgate.model.changed")
    p.add_argument("paths", nargs="+", help="HF model directories or .gguf files")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between looks")
    p.add_argument("--debounce", type=float, default=10.0, help="seconds a change must settle before it counts")
    _event_args(p)
    p.set_defaults(func=_watch)

    p = subparsers.add_parser("notify", help="emit quantgate.model.changed for a model reference (e.g. from CI)")
    p.add_argument("model", help="model reference: smollm2-135m, a HF model dir or a .gguf file")
    p.add_argument("--wait", type=float, default=90.0, help="seconds to wait for the triggered run to appear")
    _event_args(p)
    p.set_defaults(func=_notify)


def _release_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model reference (default: the embedded SmolLM2-135M)")
    _event_args(p)
    p.add_argument("--canary-requests", type=int, default=24, help="replayed requests in the canary stage")
    p.add_argument("--canary-share", type=float, default=0.5, help="share of canary traffic sent to the challenger")
    p.add_argument("--canary-backend", choices=["local", "ray"], default=None,
                   help="canary servers: local (loopback servers + our router, the default) or ray (a local Ray Serve fleet)")
    p.add_argument("--approval-timeout", type=int, default=24 * 3600, help="seconds to wait for a manual decision")
    p.add_argument("--fresh", action="store_true", help="ignore cached quantizations and measurements")
    p.add_argument("--recipe-from-tune", default=None, metavar="FILE",
                   help="release the recipe `quantgate tune` chose (its result file) instead of --methods, on "
                        "the tune's suites and items per task, and its policy unless --policy says otherwise")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this file")
    p.add_argument("--verbose", action="store_true", help="show Prefect's run logs in the terminal too")
    _ray_arg(p)


def _ray_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="quantize, measure and evaluate every model on this Ray cluster (host:port of its head, or "
                        "auto), one Prefect task per quantization, per model's serving measurement and per model and "
                        "suite (prefect-ray's RayTaskRunner); the paired speed rounds and the canary stay in this "
                        "process. Every node must see this QUANTGATE_HOME (shared storage): checked first "
                        "(flows/ray_cluster.py, docs/team.md)")


def _plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--plan: size n per task instead of releasing (gates/release_plan.py)")
    g.add_argument("--plan", action="store_true", help="print the n per task at which a variant equal to the baseline "
                   "passes every task gate with the policy's power.family_harmless_pass, the other families' items, "
                   "chunks, probes and speed rounds with their power, and the release time on this machine (a short "
                   "pilot of the engine on --model, or --from-run's speed rounds); exit")
    g.add_argument("--plan-level", type=float, default=None, help="family harmless-pass level (default: the policy's)")
    g.add_argument("--flip-rate", type=float, default=None, help="per-item answer changes of a harmless variant "
                   "(default: the --from-run run's per task, else gates.judging.power.DEFAULT_FLIP_RATE)")
    g.add_argument("--from-run", default=None, help="a recorded variant run: its flip rates, baseline scores, CIs")
    g.add_argument("--seconds-per-item", default=None, help="eval seconds per item and model: S or TASK=S,... "
                   "(default: measured by the pilot)")
    g.add_argument("--no-pilot", dest="pilot", action="store_false", help="no pilot of the engine: seconds per item "
                   "as given, else gates.judging.power.DEFAULT_SECONDS_PER_ITEM, and no speed-round time")


def _methods_arg(p: argparse.ArgumentParser) -> None:
    from quantize.methods import DEFAULT_METHODS

    per_device = "; ".join(f"{kind}: {','.join(methods)}" for kind, methods in DEFAULT_METHODS.items())
    p.add_argument("--methods", default=None, help=f"comma-separated quantization methods (default: the serving "
                                                   f"device's, {per_device})")
    p.add_argument("--device", default=None, help="where every model is served: auto, cpu, cuda or cuda:N (default "
                   "$QUANTGATE_DEVICE, else CUDA when torch sees a GPU, else the CPU)")


def chosen_methods(args: argparse.Namespace) -> list[str]:
    """`--methods`, else the default methods of the device the release serves on (quantize/methods.py)."""
    if args.methods:
        return _methods(args.methods)
    from flows.machine import resolve_device
    from quantize.methods import default_methods

    return list(default_methods(resolve_device(getattr(args, "device", None))))


def _event_args(p: argparse.ArgumentParser) -> None:
    _methods_arg(p)
    p.add_argument("--policy", default=None, help="gate policy YAML (default gates/policy.yaml)")
    p.add_argument("--approve", choices=["auto", "manual"], default="auto",
                   help="auto: approve every variant whose gates pass; manual: pause for a release manager")
    p.add_argument("--limit", type=int, default=None, help="items per eval task (default: all)")
    p.add_argument("--suites", default=",".join(DEFAULT_SUITES),
                   help=f"eval suites and/or task names (default {','.join(DEFAULT_SUITES)})")


def _methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    return methods


def _policy(path: str | None) -> str | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"policy file not found: {p}")
    return str(p.resolve())


def _logs_to_api(verbose: bool) -> None:
    """Stage logs go to the Prefect API (the UI shows them); the terminal gets progress bars instead."""
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "INFO" if verbose else "WARNING")


def run_release(args: argparse.Namespace, model: str, methods: list[str]) -> int:
    _logs_to_api(args.verbose)
    prepare()  # this verb's edge: Prefect's environment, before anything below imports Prefect
    import json
    import time

    from flows.progress import terminal_progress
    from flows.release import check_options, release_flow
    from flows.runtime import work_dir
    from flows.summary import print_summary
    from quantgate.models import resolve_model

    policy = _policy(getattr(args, "policy", None))
    approve = getattr(args, "approve", "auto")
    suites = _methods(getattr(args, "suites", ",".join(DEFAULT_SUITES)))
    check_options(methods, approve, args.limit, policy, suites)
    resolve_model(model)  # an unknown reference fails here, before a flow run exists
    log_file = None if args.verbose else work_dir("logs") / f"release-{time.strftime('%Y%m%d-%H%M%S')}.log"
    if log_file is not None:
        print(f"progress below; library output and warnings go to {log_file}", file=sys.stderr)
    with terminal_progress(log_file):
        summary = release_flow(
            model=model,
            methods=methods,
            policy=policy,
            approve=approve,
            limit=args.limit,
            suites=suites,
            approval_timeout_s=getattr(args, "approval_timeout", 24 * 3600),
            canary_requests=getattr(args, "canary_requests", 24),
            canary_share=getattr(args, "canary_share", 0.5),
            canary_backend=getattr(args, "canary_backend", None) or "local",
            fresh=getattr(args, "fresh", False),
            device=getattr(args, "device", None),
            ray_address=getattr(args, "ray_address", None),
        )
    print_summary(summary)
    if getattr(args, "json", None):
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=2, default=str)
    return 0


def _release(args: argparse.Namespace) -> int:
    if args.plan:
        from flows.memory_plan import plan_for
        from flows.time_shape import first_release_snapshot, release_shape
        from gates.judging.policy import load_policy
        from gates.release_plan import plan_report
        from quantize.capacity import split_variant

        methods, policy, suites = chosen_methods(args), load_policy(_policy(args.policy)), _methods(args.suites)
        kv = sum(1 for m in methods if split_variant(m)[1] != "auto")  # the variants the long-context probes run
        memory = plan_for(args.model, methods, policy, getattr(args, "device", None)).table()  # no model loaded
        stages = release_shape(policy, methods, suites, args.limit, args.canary_requests,
                               snapshot=args.pilot and first_release_snapshot(args.model))
        print(plan_report(policy, suites, models=1 + len(methods),
                          level=args.plan_level, flip_rate=args.flip_rate, seconds=args.seconds_per_item,
                          from_run=args.from_run, model=args.model, kv_variants=kv, measure=args.pilot,
                          memory=memory, stages=stages), end="")
        return 0
    if args.recipe_from_tune:
        from flows.tune_cli import from_tune

        return run_release(*from_tune(args, args.recipe_from_tune))
    return run_release(args, args.model, chosen_methods(args))


def _tune(args: argparse.Namespace) -> int:
    _logs_to_api(args.verbose)
    from flows.tune_cli import run_tune

    return run_tune(args, _policy(args.policy))


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    Console(stderr=True).print(
        f"[bold]quantgate demo[/bold]: release of the embedded SmolLM2-135M-Instruct "
        f"({','.join(chosen_methods(args))}), "
        f"{args.limit} items per eval task ({args.suites}), auto-approval, canary, promotion; gates from {args.policy}"
    )
    return run_release(args, "smollm2-135m", chosen_methods(args))


def _approve(args: argparse.Namespace) -> int:
    prepare()  # this verb's edge: Prefect's environment, before anything below imports Prefect
    from flows.approval import paused_runs, submit_decision

    if args.list or not args.run_id:
        runs = paused_runs()
        if not runs:
            print("no release waits for a decision")
        for run in runs:
            print(f"{run.id}  {run.name}  model={run.parameters.get('model')}  paused since {run.state.timestamp}")
        if not args.list and not args.run_id:
            raise ValueError("give the RUN_ID of the paused release (see `quantgate approve --list`)")
        return 0
    state = submit_decision(args.run_id, approve=not args.reject, comment=args.comment, by=args.by,
                            variants=args.variant, wait_s=args.wait)
    verb = "rejected" if args.reject else "approved"
    print(f"{verb} flow run {args.run_id}; the release records the decision in MLflow (run state now: {state})")
    return 0


def _deploy(args: argparse.Namespace) -> int:
    prepare()  # this verb's edge: Prefect's environment, before anything below imports Prefect
    from flows.deploy import DEPLOYMENT_NAME, EVENT_NAME, FLOW_NAME, exit_at_once, serve_deployment

    name = args.name or DEPLOYMENT_NAME
    if args.work_pool:
        from flows.deploy import register_on_work_pool

        deployment_id = register_on_work_pool(args.work_pool, name, ray_address=args.ray_address)
        print(f"registered {FLOW_NAME}/{name} ({deployment_id}) on the work pool {args.work_pool!r} of "
              f"{os.environ['PREFECT_API_URL']}: each {EVENT_NAME!r} event starts a run there; start workers with\n"
              f"  prefect worker start --pool {args.work_pool}")
        return 0

    def serving(api_url: str) -> None:
        where = f" on the Ray cluster {args.ray_address}" if args.ray_address else ""
        print(f"serving {FLOW_NAME}/{name} on the Prefect API {api_url}: a run{where} starts on each {EVENT_NAME!r} "
              "event (`quantgate watch PATH` or `quantgate notify REF`); Ctrl-C or SIGTERM stops, cancelling "
              "the runs in flight", file=sys.stderr, flush=True)

    serve_deployment(name, on_serving=serving, ray_address=args.ray_address)
    exit_at_once(0)
    return 0


def _payload(args: argparse.Namespace, **extra) -> dict:
    from flows.deploy import event_payload

    return event_payload(chosen_methods(args), _policy(args.policy), args.approve, args.limit,
                         suites=_methods(args.suites), **extra)


def _notify(args: argparse.Namespace) -> int:
    prepare()  # this verb's edge: Prefect's environment, before anything below imports Prefect
    from quantgate.models import resolve_model

    model = args.model
    resolve_model(model)  # a reference nobody can resolve is an error here, not in a run later
    if os.path.exists(model):
        model = os.path.abspath(model)
    from flows.deploy import notify

    payload = _payload(args, reason="notify")
    result = notify(model, payload, wait_s=args.wait)
    print(f"emitted quantgate.model.changed for {model} (event {result.event_id})")
    if result.deployment is None:
        print("no deployment is registered: start one with `quantgate deploy` to act on these events", file=sys.stderr)
    elif result.flow_run_id:
        print(f"triggered {result.deployment}: flow run {result.flow_run_name} ({result.flow_run_id})")
    else:
        print(f"no run of {result.deployment} appeared within {args.wait:.0f} s", file=sys.stderr)
        return 1
    return 0


def _watch(args: argparse.Namespace) -> int:
    prepare()  # this verb's edge: Prefect's environment, before anything below imports Prefect
    from flows.watch import ModelWatcher

    watcher = ModelWatcher(args.paths, debounce_s=args.debounce)
    payload = _payload(args, reason="watch")
    from flows.deploy import notify

    def on_change(change) -> None:
        result = notify(str(change.path), {**payload, "content_hash": change.new_digest}, wait_s=30.0)
        run = f"flow run {result.flow_run_id}" if result.flow_run_id else "no run seen yet"
        print(f"{change.path} changed (sha256 {change.new_digest[:12]}): event {result.event_id}, {run}", flush=True)

    print(f"watching {len(watcher.items)} path(s) every {args.interval:g} s (debounce {args.debounce:g} s); Ctrl-C stops",
          file=sys.stderr)
    watcher.run(on_change, interval_s=args.interval)
    return 0
