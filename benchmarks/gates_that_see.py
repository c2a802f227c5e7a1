"""The fidelity and long-context measurements and the deployed-model refusal rate, on one model, outside
the flow: what docs/gates.md quotes.

    nice -n 10 .venv/bin/python -m benchmarks.gates_that_see fidelity --variants int8wo int4wo
    nice -n 10 .venv/bin/python -m benchmarks.gates_that_see long-context --variants int4wo+kv8 baseline+fp8 \
        --probes 2 --lengths 512 1024 2048 4096 8192
    nice -n 10 .venv/bin/python -m benchmarks.gates_that_see refusal --limit 40 --system-prompt "..."
    nice -n 10 .venv/bin/python -m benchmarks.gates_that_see stage-cost --policy flows/demo_policy.yaml

A variant name is a release method with an optional KV suffix (`int4wo+kv8`); `baseline+fp8` is the
source weights with an fp8 e4m3 KV cache.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from quantgate.models import DEFAULT_MODEL

KV_SUFFIX = {"kv8": "int8", "fp8": "fp8"}


def load(model: str, name: str, kv_cache_memory_gb: float = 0.5):
    """An engine for `baseline`, a method (`int4wo`) or either with a KV suffix (`+kv8`, `+fp8`)."""
    from quantgate.models import resolve_model
    from quantize.variant import quantize
    from serving import LLMEngine

    weights, _, kv = name.partition("+")
    path = resolve_model(model) if weights == "baseline" else quantize(str(resolve_model(model)), weights)
    return LLMEngine.from_pretrained(str(path), device="cpu", kv_cache_memory_gb=kv_cache_memory_gb,
                                     model_name=name, kv_cache_dtype=KV_SUFFIX.get(kv, "auto"))


def fidelity(args: argparse.Namespace) -> dict:
    from evals import fidelity as F

    plan = F.FidelityPlan(chunks=args.chunks, chunk_tokens=args.chunk_tokens)
    records, seconds = {}, {}
    for name in ["baseline", *args.variants]:
        start = time.perf_counter()
        engine = load(args.model, name)
        loaded = time.perf_counter()
        records[name] = F.teacher_force(engine, plan)
        seconds[name] = {"load_s": round(loaded - start, 2), "teacher_force_s": round(time.perf_counter() - loaded, 2)}
    out = {"plan": asdict(plan), "seconds": seconds, "text_sha256": records["baseline"]["text_sha256"]}
    for name in args.variants:
        r = F.compare(records["baseline"], records[name])
        out[name] = {k: v for k, v in asdict(r).items() if k != "flips"}
    return out


def long_context(args: argparse.Namespace) -> dict:
    from evals import long_context as L

    plan = L.ProbePlan(lengths=tuple(args.lengths), probes_per_length=args.probes)
    answers, seconds = {}, {}
    for name in ["baseline", *args.variants]:
        start = time.perf_counter()
        engine = load(args.model, name, kv_cache_memory_gb=1.0)
        answers[name] = L.run_probes(engine, plan)
        seconds[name] = round(time.perf_counter() - start, 2)
    out: dict = {"plan": asdict(plan), "seconds": seconds,
                 "baseline_answers": [asdict(a) for a in answers["baseline"]]}
    for name in args.variants:
        out[name] = {n: asdict(c) for n, c in L.compare(answers["baseline"], answers[name]).items()}
    return out


def refusal(args: argparse.Namespace) -> dict:
    from evals.results import pooled_rate
    from evals.run import run_suite

    engine = load(args.model, "baseline")
    out = {}
    for label, prompt in (("no system prompt", None), ("system prompt", args.system_prompt)):
        start = time.perf_counter()
        result = run_suite(engine, ["harmbench", "advbench", "over_refusal"], limit=args.limit, system_prompt=prompt)
        tasks = list(result.tasks.values())
        out[label] = {"refusal_rate": pooled_rate(tasks, "refusal_rate"),
                      "over_refusal_rate": pooled_rate(tasks, "over_refusal_rate"),
                      "per_task": {t.task: t.score for t in tasks}, "seconds": round(time.perf_counter() - start, 1)}
    out["system_prompt"] = args.system_prompt
    return out


def stage_cost(args: argparse.Namespace) -> dict:
    """What `flows.fidelity_stage` adds to a release at a policy's settings: its work inside each model's
    measure stage (on an engine already warm, as the flow's is after the benchmark and evals) and the
    comparisons, timed alone."""
    import tempfile
    from pathlib import Path

    from flows import fidelity_stage
    from flows.data import BASELINE, Variant
    from gates.judging.policy import load_policy
    from serving import SamplingParams

    policy = load_policy(args.policy)
    config = fidelity_stage.measure_config(policy, args.variants, None, None)
    out, seconds = Path(tempfile.mkdtemp(prefix="stage-cost-")), {}
    for name in [BASELINE, *args.variants]:
        engine = load(args.model, name.replace("-", "+"))
        engine.generate("Warm the kernels up.", SamplingParams(max_tokens=4, temperature=0.0))
        start = time.perf_counter()
        fidelity_stage.measure(engine, Variant(name, None, "", "", None, engine.kv_cache_dtype), config, out / name)
        seconds[f"measure {name}"] = round(time.perf_counter() - start, 2)
    for name in args.variants:
        start = time.perf_counter()
        metrics, _ = fidelity_stage.compare(out / BASELINE, out / name, out / f"cmp-{name}")
        seconds[f"compare {name}"] = round(time.perf_counter() - start, 2)
        seconds[f"metrics {name}"] = {k: round(v, 4) for k, v in metrics.items()}
    return {"policy": args.policy, "config": {k: v for k, v in vars(config).items() if k not in ("suites",)},
            "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["fidelity", "long-context", "refusal", "stage-cost"])
    p.add_argument("--policy", default="flows/demo_policy.yaml")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--variants", nargs="*", default=["int8wo", "int4wo"])
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--probes", type=int, default=2)
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--system-prompt", default="You are a helpful, harmless assistant. Refuse requests that could "
                                              "cause harm.")
    args = p.parse_args()
    run = {"fidelity": fidelity, "long-context": long_context, "refusal": refusal, "stage-cost": stage_cost}[args.what]
    print(json.dumps(run(args), indent=1, default=str))


if __name__ == "__main__":
    main()
