"""`quantgate tune MODEL --policy P`, and reading its result for `quantgate release --recipe-from-tune FILE`."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_MODEL_REF = "smollm2-135m"  # `quantgate release --model`'s default

def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="find the smallest (or fastest) quantization recipe that passes every gate")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL_REF, help="model reference (default: the embedded SmolLM2-135M)")
    p.add_argument("--policy", default=None, help="gate policy YAML (default gates/policy.yaml)")
    p.add_argument("--objective", choices=["smallest", "fastest"], default="smallest",
                   help="smallest: candidates smallest first; fastest: fastest layout first (paired speed rounds)")
    p.add_argument("--candidates", default=None,
                   help="comma-separated recipes (default: int4_{rtn,awq,gptq}_g{128,64,32} and int8wo, each also +kv8)")
    p.add_argument("--limit", type=int, default=40, help="items per eval task in each split (search, held-out)")
    p.add_argument("--suites", default="accuracy,safety", help="eval suites and/or task names (default accuracy,safety)")
    p.add_argument("--fresh", action="store_true", help="ignore cached quantizations and measurements")
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.add_argument("--verbose", action="store_true", help="show Prefect's run logs in the terminal too")
    return p


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("the list is empty")
    return names


def run_tune(args: argparse.Namespace, policy: str | None) -> int:
    """The verb's body; flows/cli.py has set where the logs go and checked the policy path. Its imports are
    late (`quantgate --help` imports this module): Prefect, torch and MLflow load only when the verb runs."""
    from flows.runtime import prepare

    prepare()  # the CLI edge sets Prefect's environment, before the imports below read it
    from flows.progress import terminal_progress
    from flows.runtime import work_dir
    from flows.tune import check_options, tune_flow
    from flows.tune_report import render
    from quantgate.models import resolve_model

    candidates, suites = _names(args.candidates), _names(args.suites)
    check_options(candidates, args.objective, args.limit, policy, suites)
    resolve_model(args.model)  # an unknown reference fails here, before a flow run exists
    log_file = None if args.verbose else work_dir("logs") / f"tune-{time.strftime('%Y%m%d-%H%M%S')}.log"
    if log_file is not None:
        print(f"progress below; library output and warnings go to {log_file}", file=sys.stderr)
    with terminal_progress(log_file):
        result = tune_flow(model=args.model, policy=policy, candidates=candidates, objective=args.objective,
                           limit=args.limit, suites=suites, fresh=args.fresh, result_file=args.json)
    print(render(result), end="")
    return 0 if result["chosen"] else 1


def from_tune(args: argparse.Namespace, path: str) -> tuple[argparse.Namespace, str, list[str]]:
    """(args, model, [recipe]) for releasing a tune result: its model (refused if --model names another, or
    if the model changed since), the tune's suites and items per task (a default `--suites` would leave
    the items the search judged the recipe on out of the gates' reach), its policy unless --policy names
    another. The caller's args are left as they were."""
    from flows.tune_report import chosen_recipe
    from quantgate.models import resolve_model
    from quantize.variant import cached_content_hash

    tuned = chosen_recipe(path)
    if args.model not in (DEFAULT_MODEL_REF, tuned.model_ref):
        raise ValueError(f"{path} was tuned for {tuned.model_ref}, not {args.model}")
    now = cached_content_hash(resolve_model(tuned.model_ref))
    if now != tuned.source_hash:
        raise ValueError(f"{tuned.model_ref} changed since it was tuned "
                         f"(sha256 {tuned.source_hash[:12]} then, {now[:12]} now): tune again")
    policy = args.policy if args.policy is not None else tuned.policy
    release_args = argparse.Namespace(**{**vars(args), "suites": ",".join(tuned.suites), "limit": tuned.limit,
                                         "policy": policy})
    return release_args, tuned.model_ref, [tuned.recipe]
