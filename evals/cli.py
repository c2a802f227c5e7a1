"""`quantgate eval` and `quantgate compare`; heavy imports happen inside the handlers."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser("eval", help="evaluate a model task by task (lm-eval through the engine)",
                               description="Run the accuracy and/or safety suites through quantgate's engine; "
                                           "writes lm-eval results, per-sample JSONL and a Markdown table.")
    ev.add_argument("--model", required=True, help="smollm2-135m, a HF model dir, a quantized variant dir or a .gguf")
    ev.add_argument("--suite", default="accuracy,safety",
                    help="comma-separated suites (accuracy, safety) and/or task names (default: both suites)")
    ev.add_argument("--limit", type=int, default=None, help="evaluate only the first N items of each task")
    ev.add_argument("--out", required=True, type=Path, help="output directory")
    ev.add_argument("--device", default=None, help="engine device (default: cuda if available, else cpu)")
    ev.add_argument("--dtype", default=None, help="engine dtype (float32, bfloat16, ...)")
    ev.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is far faster when other processes share the cores)")
    ev.set_defaults(func=_eval)

    cmp = subparsers.add_parser("compare", help="paired task-by-task comparison of variants against a baseline",
                                description="Compare eval result directories: per-task delta with a paired "
                                            "bootstrap 95% CI, exact McNemar p, flipped items, plots.")
    cmp.add_argument("baseline", type=Path, help="eval output directory of the baseline")
    cmp.add_argument("variants", type=Path, nargs="+", help="eval output directories of the variants")
    cmp.add_argument("--out", required=True, type=Path, help="output directory for compare.md/json and PNGs")
    cmp.add_argument("--seed", type=int, default=None, help="bootstrap seed (default: fixed)")
    cmp.add_argument("--n-boot", type=int, default=None, help="bootstrap resamples (default 2000)")
    cmp.add_argument("--fail-on-regression", action="store_true",
                     help="exit with status 1 when any task is flagged as a significant regression")
    cmp.set_defaults(func=_compare)


def _eval(args: argparse.Namespace) -> int:
    from evals.lm import EngineLM
    from evals.run import markdown_table, run_suite
    from evals.tasks import resolve_tasks
    from quantgate.models import resolve_model

    resolve_model(args.model)  # bad references and task names fail before anything loads
    resolve_tasks(args.suite)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    engine_kwargs = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}
    lm = EngineLM.from_model(args.model, **engine_kwargs)
    result = run_suite(lm, args.suite, limit=args.limit, out_dir=args.out)
    print(markdown_table(result))
    print(f"wrote {args.out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from evals.compare import DEFAULT_BOOT, DEFAULT_SEED, compare, load_results, markdown, write_report
    from evals.results import EvalResult

    baseline = EvalResult.load(args.baseline)
    variants = load_results(args.variants)
    seed = DEFAULT_SEED if args.seed is None else args.seed
    comparison = compare(baseline, variants, seed=seed, n_boot=args.n_boot or DEFAULT_BOOT)
    write_report(comparison, baseline, variants, args.out, seed=seed)
    print(markdown(comparison, max_flips=0).split("\n## ")[0])
    print(f"wrote {args.out}")
    return 1 if args.fail_on_regression and comparison.flagged() else 0
