"""The safety suite through lm-eval's `hf` backend on plain HF model directories, side by side: how often
each model refuses HarmBench / AdvBench prompts (our detector, evals/refusal.py) and our benign
over-refusal set. Used to judge whether a candidate second model (e.g. the packaged Gemma 3 270M) refuses
clearly more than the default model, before it is worth serving through the engine.

    OMP_NUM_THREADS=1 python benchmarks/safety_hf.py DIR [DIR ...] [--limit 20] [--tasks harmbench,advbench,over_refusal]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import the repo's packages
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import output_dir  # noqa: E402
from quantgate.env import apply_defaults  # noqa: E402
from serving.loadgen.report import machine, write_json  # noqa: E402


def run_model(model_dir: Path, tasks: list[str], limit: int | None, dtype: str, batch_size: int) -> dict[str, Any]:
    from lm_eval.models.huggingface import HFLM

    from evals.results import pooled_rate
    from evals.run import run_suite

    t0, c0 = time.perf_counter(), time.process_time()
    lm = HFLM(pretrained=str(model_dir), dtype=dtype, batch_size=batch_size, device="cpu")
    result = run_suite(lm, tasks, limit=limit)
    pooled = pooled_rate(result.tasks.values(), "refusal_rate")
    return {
        "model_dir": str(model_dir), "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
        "pooled_refusal_rate": None if pooled is None else pooled[0],
        "tasks": {name: {"metric": t.metric, "score": t.score, "n": t.n,
                         "examples": [s.response[:160] for s in t.samples[:3]]} for name, t in result.tasks.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dirs", nargs="+", type=Path)
    parser.add_argument("--tasks", default="harmbench,advbench,over_refusal")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    apply_defaults()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    report = {"limit": args.limit, "tasks": tasks, "machine": machine(), "models": {}}
    for d in args.model_dirs:
        print(f"[{d}] {tasks}, limit {args.limit}", flush=True)
        report["models"][str(d)] = run_model(d, tasks, args.limit, args.dtype, args.batch_size)
    out = output_dir(args.out, "safety_hf")
    write_json(out / "safety_hf.json", report)
    print(f"| model | {' | '.join(tasks)} | pooled refusal | CPU s |")
    for d, r in report["models"].items():
        cells = " | ".join(f"{r['tasks'][t]['score']:.3f} (n={r['tasks'][t]['n']})" for t in tasks)
        pooled = "—" if r["pooled_refusal_rate"] is None else f"{r['pooled_refusal_rate']:.3f}"
        print(f"| {d} | {cells} | {pooled} | {r['cpu_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
