"""INT4 methods through the engine on real benchmarks: paired deltas with CIs against the baseline.

The rest of the comparison in benchmarks/int4_methods.py (top-1, KL, bits per byte on dequantized weights)
says how far a method moves the model's predictions; this runs the variants the `quantize` command builds
(`int4wo` = round-to-nearest, `int4-gptq`, `int4-awq`, each at one group size) and the baseline through
quantgate's own engine (as the release's measure stage loads them) on the demo's real tasks (ARC-Easy,
PIQA, HellaSwag, WinoGrande; lm-eval's own task configs, the first `--limit` items of each), and compares
each with the baseline item by item with the project's comparison (evals/compare.py: paired bootstrap 95 %
CI of the delta, exact McNemar p, flips). Eval CPU seconds of one torch thread per task and the
quantization time of each variant (its manifest) come with it.

    nice -n 10 .venv/bin/python -m benchmarks.int4_methods_evals --group-size 64 --limit 100 \\
        --json docs/results/int4_methods_evals_smollm2_g64.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

TASKS = ("arc_easy", "piqa", "hellaswag", "winogrande")
METHODS = ("int4wo", "int4-gptq", "int4-awq")


def build_variants(model: str, methods: list[str], group_size: int) -> dict[str, dict[str, Any]]:
    """Each method's variant at `group_size` (cached by the quantize command's key), with its build time."""
    from quantize import quantize, read_manifest

    built = {}
    for method in methods:
        start, cpu = time.perf_counter(), time.process_time()
        path = quantize(model, method, group_size=group_size)
        manifest = read_manifest(path)
        built[method] = {"path": str(path), "quantize_seconds": manifest.get("quantize_seconds"),
                         "algorithm_seconds": (manifest.get("algorithm") or {}).get("seconds"),
                         "options": manifest.get("options"),
                         "calibration": manifest.get("calibration"),
                         "this_call_s": round(time.perf_counter() - start, 1),
                         "this_call_cpu_s": round(time.process_time() - cpu, 1)}
        print(f"{method}: {path} (built in {manifest.get('quantize_seconds')} s)", flush=True)
    return built


def evaluate(name: str, path: str, tasks: list[str], limit: int, out: Path) -> dict[str, dict[str, float]]:
    """One model through the engine, task by task into out/<name>/<task>; CPU and wall seconds per task."""
    from evals.run import run_suite
    from serving import LLMEngine

    record = out / name / "times.json"
    times = json.loads(record.read_text()) if record.is_file() else {}
    todo = [t for t in tasks if not (out / name / t / "summary.json").is_file()]  # a stopped run resumes
    if not todo:
        return times
    engine = LLMEngine.from_pretrained(path, device="cpu", kv_cache_memory_gb=0.5, model_name=name)
    for task in todo:
        wall, cpu = time.perf_counter(), time.process_time()
        run_suite(engine, [task], limit=limit, out_dir=out / name / task)
        times[task] = {"cpu_s": round(time.process_time() - cpu, 1), "wall_s": round(time.perf_counter() - wall, 1),
                       "load1": round(os.getloadavg()[0], 2)}
        record.write_text(json.dumps(times))
        print(f"{name} {task}: {times[task]}", flush=True)
    del engine
    return times


def load(out: Path, name: str):
    from evals.results import EvalResult

    results = [EvalResult.load(p) for p in sorted((out / name).iterdir()) if (p / "summary.json").is_file()]
    merged = results[0]
    for r in results[1:]:
        merged.tasks.update(r.tasks)
    return merged


def comparison_rows(out: Path, names: list[str], reference: str = "baseline") -> tuple[list[dict], list[dict]]:
    """Per (variant, task): paired delta against `reference`, its 95 % CI, McNemar p, flips; and the mean
    over tasks."""
    from evals.compare import compare

    result = compare(load(out, reference), {n: load(out, n) for n in names if n != reference})
    rows = [{"variant": r.variant, "task": r.task, "metric": r.metric, "n": r.n, "baseline": round(r.baseline, 4),
             "variant_score": round(r.variant_score, 4), "delta": round(r.delta, 4), "ci_low": round(r.ci_low, 4),
             "ci_high": round(r.ci_high, 4),
             "mcnemar_p": None if r.mcnemar_p is None else round(r.mcnemar_p, 4),
             "right_to_wrong": len(r.lost), "wrong_to_right": len(r.gained), "flagged": r.flagged}
            for r in result.rows]
    means = [{"variant": a.variant, "tasks": a.tasks, "baseline": round(a.baseline, 4),
              "variant_score": round(a.variant_score, 4), "delta": round(a.delta, 4),
              "ci_low": round(a.ci_low, 4), "ci_high": round(a.ci_high, 4)} for a in result.aggregates]
    return rows, means


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=int, default=100, help="first N items of each task")
    parser.add_argument("--out", type=Path, default=Path("/tmp/quantgate-int4-methods-evals"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    from quantgate.models import DEFAULT_MODEL_NOTE, is_default_model, resolve_model
    from serving.kernels.cpu import isa as isas

    torch.set_num_threads(1)  # CPU time of one thread: what an idle run costs, on a shared machine
    methods = [m for m in args.methods.split(",") if m]
    tasks = [t for t in args.tasks.split(",") if t]
    built = build_variants(args.model, methods, args.group_size)
    models = {"baseline": str(resolve_model(args.model))} | {m: built[m]["path"] for m in methods}
    for name, path in models.items():
        evaluate(name, path, tasks, args.limit, args.out)
    times = {name: json.loads((args.out / name / "times.json").read_text()) for name in models}
    rows, means = comparison_rows(args.out, methods)
    # the calibrated methods against round-to-nearest itself, item by item
    versus_rtn = comparison_rows(args.out, methods, "int4wo") if "int4wo" in methods and len(methods) > 1 else None
    report = {"model": args.model, "note": DEFAULT_MODEL_NOTE if is_default_model(args.model) else None,
              "machine": isas.cpu_model(), "isa": isas.resolve(),
              "threads": 1, "group_size": args.group_size, "limit": args.limit, "tasks": tasks,
              "variants": built, "eval_seconds": times, "rows": rows, "means": means,
              "versus_int4wo": None if versus_rtn is None else {"rows": versus_rtn[0], "means": versus_rtn[1]}}
    for row in rows:
        print(f"{row['variant']:>10} {row['task']:>10}: n {row['n']}  {row['baseline']:.3f} -> "
              f"{row['variant_score']:.3f}  delta {row['delta']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]  "
              f"McNemar p {row['mcnemar_p']}  lost {row['right_to_wrong']} gained {row['wrong_to_right']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return report


if __name__ == "__main__":
    main()
