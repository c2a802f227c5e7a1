"""What the evidence bundle costs on the default model: a release recorded from the cached source and
variant directories (crafted per-item logs: 10 tasks x 40 items per run, the demo policy), then
`write_evidence` (signed) and `verify` timed, and the manifest's size.

    QUANTGATE_HOME=/tmp/ev MLFLOW_TRACKING_URI=sqlite:////tmp/ev/m.db python -m benchmarks.evidence_cost

reads the default model and its int8wo/int4wo variants from ~/.cache/quantgate (quantize them first).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

TASKS = ("arith", "cloze", "facts_mc", "instruct", "json_format", "one_word", "arc_easy", "piqa", "hellaswag",
         "winogrande")
ITEMS = 40


def _evals(out: Path) -> Path:
    from evals.results import EvalResult, SampleResult, TaskResult

    tasks = {}
    for t in TASKS:
        samples = [SampleResult(i, f"{t}-{i:04d}", "a", "a" if i % 3 else "b", float(i % 3 > 0), i % 3 > 0)
                   for i in range(ITEMS)]
        tasks[t] = TaskResult(t, "accuracy", "acc", sum(s.score for s in samples) / ITEMS, ITEMS, True, True, 0.25,
                              False, 0, samples=samples)
    EvalResult("model", "engine", ["accuracy"], ITEMS, "crafted", tasks).save(out / "accuracy")
    return out / "accuracy"


def _metrics(weights: Path, variant: bool) -> dict[str, float]:
    from gates import metric_names as M
    from serving.model.quant.integrity import weight_bytes

    out = {M.WEIGHTS_BYTES: float(weight_bytes(weights)[0])}
    for t in TASKS:
        out.update(M.task_metrics(t, 0.6, delta=0.0, ci_low=-0.05, ci_high=0.05, n=ITEMS) if variant
                   else M.task_metrics(t, 0.6, n=ITEMS))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "quantgate")
    args = parser.parse_args()

    from gates.evidence.manifest import MANIFEST_PATH, write_evidence
    from gates.evidence.signing import generate_keypair
    from gates.evidence.verify import verify
    from gates.records.evaluation import evaluate_run
    from gates.records.registry import record_approval
    from gates.records.tracking import end_release, get_client, log_variant, register_variant, start_release
    from quantgate.models import content_hash
    from serving.model.quant.integrity import read_manifest

    source = args.cache / "models" / "smollm2-135m-instruct"
    variants = {p.name.split("-", 1)[1]: p for p in sorted((args.cache / "variants").iterdir()) if p.is_dir()}
    policy = Path(__file__).resolve().parents[1] / "flows" / "demo_policy.yaml"
    with tempfile.TemporaryDirectory(prefix="evidence-cost-") as tmp:
        work = Path(tmp)
        release = start_release("smollm2-evidence-cost", content_hash(source), {})
        log_variant(release, "baseline", {"method": "none", "variant_path": str(source)}, _metrics(source, False),
                    artifacts=[_evals(work / "baseline")])
        for name, directory in variants.items():
            run = log_variant(release, name, {"method": name, "variant_path": str(directory)},
                              _metrics(directory, True), artifacts=[_evals(work / name)],
                              manifest=read_manifest(directory))
            version = register_variant(run, source=directory)
            evaluate_run(run, str(policy))
            record_approval("smollm2-evidence-cost", version, by="bench")
        end_release(release)
        private, public = generate_keypair(work / "keys")
        start = time.perf_counter()
        write_evidence(release, signing_key=private)
        written_s = time.perf_counter() - start
        start = time.perf_counter()
        report = verify(release, verify_key=public)
        verified_s = time.perf_counter() - start
        size = Path(get_client().download_artifacts(release, MANIFEST_PATH, str(work))).stat().st_size
    print(f"source + {', '.join(variants)}: write_evidence {written_s:.1f} s, verify {verified_s:.1f} s "
          f"({'VERIFIED' if report.ok else report.mismatches}, {len(report.checked)} checks), manifest {size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
