"""Eval time the demo's real benchmarks add per model: ARC-Easy, PIQA, HellaSwag and WinoGrande at the
demo's n, the model loaded as the release's measure stage loads it, CPU time of one torch thread (on a
shared machine that, not the wall time, says what an idle run costs). Optionally the paired comparison
of variants on the same items (flips per task).

    .venv/bin/python scripts/demo_real_benchmarks_time.py [--limit 40] [--variants int8wo,int4wo]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

TASKS = ("arc_easy", "piqa", "hellaswag", "winogrande")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--variants", default="", help="comma-separated methods to compare with the baseline")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "quantgate-demo-real-benchmarks")
    args = parser.parse_args()
    import torch

    from flows import measuring
    from flows.data import MeasureConfig, Variant
    from quantgate.models import resolve_model
    from quantize import quantize

    torch.set_num_threads(1)
    source = resolve_model("smollm2-135m")
    models = {"baseline": str(source)} | {m: str(quantize(source, m)) for m in args.variants.split(",") if m}
    times: dict[str, dict[str, dict[str, float]]] = {}
    for name, path in models.items():
        engine = measuring.load_engine(Variant(name=name, method=None, path=path, content_hash=""), MeasureConfig())
        measuring.run_evals(engine, "piqa", 5, args.out / name / "warmup")  # lm-eval's first load, not a task's
        times[name] = {}
        for task in TASKS:
            wall, cpu = time.perf_counter(), time.process_time()
            measuring.run_evals(engine, task, args.limit, args.out / name / "evals" / task)
            times[name][task] = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                                 "load1": os.getloadavg()[0]}
            print(name, task, times[name][task], flush=True)
        del engine
    print(json.dumps({m: round(sum(t["cpu_s"] for t in v.values()), 1) for m, v in times.items()}))
    from evals.compare import compare

    base = measuring.load_evals(args.out / "baseline" / "evals")
    for name in models:
        if name != "baseline":
            for r in compare(base, {name: measuring.load_evals(args.out / name / "evals")}).rows:
                print(f"{name} {r.task}: n {r.n}, baseline {r.baseline:.3f}, variant {r.variant_score:.3f}, "
                      f"CI [{r.ci_low:+.3f}, {r.ci_high:+.3f}], right->wrong {len(r.lost)}, wrong->right {len(r.gained)}")


if __name__ == "__main__":
    main()
