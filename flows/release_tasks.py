"""The release's cached, retried Prefect tasks that build and measure one model: called one after another by
flows/release.py, or submitted to a Ray cluster's nodes by flows/release_on_ray.py.

Quantization and measurements are cached by content hash (persisted results under
`quantgate.env.home()/flows/results`), so a rerun after a crash resumes from what finished.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from prefect import task

from flows import machine, measuring, ray_cluster
from flows import speed_rounds as speed_stage
from flows.data import MeasureConfig, Measured, Source, SpeedPlan, SpeedResult, Variant
from flows.progress import stage
from flows.runtime import work_dir
from flows.stage_process import StageKilled, run_stage_in_child
from quantgate.allocator import release_engine_memory
from quantize.capacity import split_variant, variant_label
from serving.model.quant.integrity import read_manifest

TASK_RETRIES = 2
RETRY_DELAY_S = 3.0
# Bump when a cached stage's output format changes (3: weights as served, machine in keys; 4: persisted
# results' MeasureConfig gained `device`, and the kernel sources moved to serving/kernels/, which changes every
# machine key: cached measurements rebuild once).
CACHE_VERSION = "4"


def transient(task, task_run, state) -> bool:
    """Retry what may pass on a second try; bad input (ValueError), refusals and a stage the OS killed (an
    OOM kill would recur: the run is recorded FAILED at once, and a rerun resumes from what finished) fail at once."""
    exc = getattr(state, "data", None)
    return not isinstance(exc, ValueError | TypeError | KeyError | StageKilled)


RETRIED = {"retries": TASK_RETRIES, "retry_delay_seconds": RETRY_DELAY_S, "retry_condition_fn": transient}


def _quantize_key(context, parameters) -> str:
    return f"quantize-{parameters['source'].content_hash}-{parameters['method']}-v{CACHE_VERSION}"


@task(name="quantize", cache_key_fn=_quantize_key, persist_result=True, **RETRIED)
def quantize_method(source: Source, method: str) -> Variant:
    with stage(f"quantize {source.name} -> {method}"):
        # the heaviest stage (a build and its GGUF conversion peaked at 20.7 GB of 24): in a child process, so
        # that an OOM kill of it is a failure this run records (flows/stage_process.py), not a dead flow
        out = run_stage_in_child(f"quantize {method}", measuring.quantize, Path(source.path), method)
        manifest = read_manifest(out)
        return Variant(name=method, method=method, path=str(out), content_hash=measuring.variant_hash(manifest),
                       manifest=manifest)


def _measure_key(context, parameters) -> str:
    """Weights, KV dtype, config and the machine (kernel sources, ISA, CPU and flags, threads, dtype)."""
    v, cfg = parameters["variant"], parameters["config"]
    kv = "" if v.kv_cache_dtype == "auto" else f"-kv-{v.kv_cache_dtype}"
    return f"measure-{v.content_hash}{kv}-{cfg.key()}-{machine.key(machine.describe(cfg.device))}-v{CACHE_VERSION}"


def _speed_key(context, parameters) -> str:
    return f"{speed_stage.cache_key(parameters['models'], parameters['plan'])}-v{CACHE_VERSION}"


@task(name="measure-speed", cache_key_fn=_speed_key, persist_result=True, **RETRIED)
def measure_speed(models: list[Variant], plan: SpeedPlan) -> SpeedResult:
    """The baseline against each variant in turn, in paired interleaved rounds, two models resident at most
    (flows.speed_rounds)."""
    pairs = max(1, len(models) - 1)
    with stage(f"paired speed: baseline vs {pairs} variant(s) x {len(plan.points())} points x {plan.rounds} rounds",
               total=plan.rounds * pairs) as advance:
        return speed_stage.measure(models, plan, work_dir("speed", speed_stage.cache_key(models, plan)),
                             machine.line(machine.describe(plan.device)), advance)


def _measure_dir(variant: Variant, config: MeasureConfig) -> Path:
    kv = "" if variant.kv_cache_dtype == "auto" else f"-kv-{variant.kv_cache_dtype}"
    return work_dir("measure", f"{variant.content_hash[:16]}{kv}-{config.key()}")


@task(name="measure", cache_key_fn=_measure_key, persist_result=True, **RETRIED)
def measure(variant: Variant, config: MeasureConfig) -> Measured:
    """Serve the model through our engine: serving benchmark, eval suites, weight bytes, KV capacity."""
    out = _measure_dir(variant, config)
    with stage(f"{variant.name}: load, benchmark, evaluate", total=2 + len(config.suites)) as advance:
        return measuring.measure(variant, config, out, advance)


# ---- the same measurement in parts, for a Ray cluster (each part a task a node runs) ------------------


def _part_key(context, parameters) -> str:
    part = parameters.get("suite") or "serving"
    return _measure_key(context, parameters).replace("measure-", f"measure-{part}-", 1)


@task(name="measure-serving", cache_key_fn=_part_key, persist_result=True, **RETRIED)
def measure_serving(variant: Variant, config: MeasureConfig) -> Measured:
    """`measure` without the eval suites (each suite is an `evaluate-suite` task of its own): the load, the serving
    benchmark, weights and KV capacity as served, fidelity and long-context probes, on one engine, in one order."""
    ray_cluster.use_task_cpus()
    with stage(f"{variant.name}: load, benchmark", total=2) as advance:
        return measuring.measure(variant, replace(config, suites=()), _measure_dir(variant, config), advance)


@task(name="evaluate-suite", cache_key_fn=_part_key, persist_result=True, **RETRIED)
def evaluate_suite(variant: Variant, config: MeasureConfig, suite: str) -> str:
    """One eval suite of one model on an engine of its own: the same `run_suite` call `measure` makes for that
    suite (the same requests, submitted together, so the engine batches them as it does there). Returns the
    suite's result directory, where `measure` writes it."""
    ray_cluster.use_task_cpus()
    out = _measure_dir(variant, config) / "evals" / suite
    docs = config.eval_docs()
    for stale in out.parent.glob(f".{suite}.partial-*"):  # an attempt whose worker was killed left its staging
        shutil.rmtree(stale, ignore_errors=True)  # (the comparison reads every folder beside the suites)
    with stage(f"{variant.name}: evaluate {suite}"):
        engine = measuring.load_engine(variant, config)
        try:
            measuring.run_evals(engine, suite, None if docs else config.limit, out, config.system_prompt,
                                config.chat_template, docs)
        finally:
            del engine
            release_engine_memory()
    return str(out)


def variants_of(weights: dict[str, Variant], methods: list[str]) -> list[Variant]:
    """Each requested variant from its weights (a KV suffix shares its method's)."""
    variants = []
    for name in methods:
        method, kv = split_variant(name)
        w = weights[method]
        label = variant_label(name)
        variants.append(Variant(label, label, w.path, w.content_hash, w.manifest, kv_cache_dtype=kv))
    return variants
