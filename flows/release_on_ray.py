"""The release's per-model work on a Ray cluster (`quantgate release --ray-address`): a nested flow whose task
runner is prefect-ray's RayTaskRunner. Quantizations, each model's serving measurement and each (model, suite)
evaluation run on the cluster's nodes; the paired speed rounds and the canary stay in the driver's process
(flows/release.py), and the cluster is checked first (flows/ray_cluster.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefect import flow

from flows import measuring, memory_plan, ray_cluster
from flows.data import BASELINE, MeasureConfig, Measured, Source, Variant
from flows.progress import note, stage
from flows.release_tasks import evaluate_suite, measure_serving, quantize_method, variants_of
from quantize.capacity import split_variant, variant_label

RAY_FLOW_NAME = "quantgate-release-on-ray"  # the nested flow whose task runner is prefect-ray's RayTaskRunner

RAY_STAGES = ("quantize ", "measure ")  # the memory plan's stages that run on the cluster's nodes


def connect(address: str, device: str, mem: memory_plan.MemoryPlan) -> ray_cluster.Cluster:
    """Connect to the cluster and check it (every node sees this home, serves at these numerics, and some node
    has the room each Ray stage plans for): `ClusterRefused` names the node otherwise, before any run exists."""
    stage_bytes = {s.name: s.total for s in mem.stages if s.name.startswith(RAY_STAGES)}
    with stage(f"Ray cluster {address}: connect, check every node's home and numerics"):
        cluster = ray_cluster.connect(address, device, stage_bytes)
    note(f"Ray cluster {address}: {len(cluster.nodes)} node(s), {cluster.task_cpus} CPU(s) per task; the paired "
         f"speed rounds and the canary run on {cluster.driver}")
    return cluster


def driver_stages(mem: memory_plan.MemoryPlan) -> memory_plan.MemoryPlan:
    """The plan of what still runs in this process on a Ray release: the paired speed rounds and the canary."""
    return replace(mem, stages=[s for s in mem.stages if not s.name.startswith(RAY_STAGES)])


def build_and_measure(cluster: ray_cluster.Cluster, source: Source, methods: list[str], config: MeasureConfig, fresh: bool,
            mem: memory_plan.MemoryPlan) -> tuple[list[Variant], Measured, list[Measured]]:
    stage_bytes = {s.name: s.total for s in mem.stages if s.name.startswith(RAY_STAGES)}
    on_ray = measure_on_ray.with_options(task_runner=ray_cluster.task_runner(cluster))
    return on_ray(source, methods, config, fresh, cluster, stage_bytes)


@flow(name=RAY_FLOW_NAME, validate_parameters=False, log_prints=True)
def measure_on_ray(source: Source, methods: list[str], config: MeasureConfig, fresh: bool,
                   cluster: ray_cluster.Cluster, stage_bytes: dict[str, int]) -> tuple[list[Variant], Measured,
                                                                                      list[Measured]]:
    """The release's per-model work, submitted to this flow's task runner (prefect-ray's RayTaskRunner on
    `cluster`): a quantize task per weight method, and per model a `measure-serving` task and an `evaluate-suite`
    task per suite. The baseline's tasks go in at once, beside the quantizations; a variant's as soon as its
    weights exist. Each task reserves the cluster's CPUs per task and its stage's planned memory; Ray runs it again
    elsewhere when its worker dies (`ray_cluster.task_options`). Returns what `_quantize_all` and `_measure` return."""
    quantize_ = quantize_method.with_options(refresh_cache=True) if fresh else quantize_method
    built = {}
    for method in dict.fromkeys(split_variant(m)[0] for m in methods):
        if method != BASELINE:
            with ray_cluster.task_options(cluster, stage_bytes.get(f"quantize {method}")):
                built[method] = quantize_.submit(source, method)
    baseline = Variant(BASELINE, None, source.path, source.content_hash, None)
    memory = {BASELINE: stage_bytes.get(f"measure {BASELINE}")}
    memory.update({variant_label(m): stage_bytes.get(f"measure {m}") for m in methods})
    parts = {BASELINE: _submit_measure(cluster, baseline, config, fresh, memory[BASELINE])}
    weights: dict[str, Variant] = {BASELINE: baseline}
    for method, future in built.items():
        v = future.result()
        if not measuring.variant_intact(Path(v.path)):
            note(f"cached variant {v.name} at {v.path} is gone or damaged: quantizing again")
            with ray_cluster.task_options(cluster, stage_bytes.get(f"quantize {method}")):
                v = quantize_method.with_options(refresh_cache=True).submit(source, method).result()
        weights[method] = v
        for variant in variants_of(weights, [m for m in methods if split_variant(m)[0] == method]):
            parts[variant.name] = _submit_measure(cluster, variant, config, fresh, memory[variant.name])
    variants = variants_of(weights, methods)
    for variant in variants:  # a KV variant of the baseline's weights had no quantize to wait for
        if variant.name not in parts:
            parts[variant.name] = _submit_measure(cluster, variant, config, fresh, memory[variant.name])
    base = _gather_measure(cluster, baseline, config, parts[BASELINE], memory[BASELINE])
    return variants, base, [_gather_measure(cluster, v, config, parts[v.name], memory[v.name]) for v in variants]


def _submit_measure(cluster: ray_cluster.Cluster, variant: Variant, config: MeasureConfig, fresh: bool,
                    memory_bytes: int | None) -> tuple:
    with ray_cluster.task_options(cluster, memory_bytes):
        serving = measure_serving.with_options(refresh_cache=fresh).submit(variant, config)
        suites = {s: evaluate_suite.with_options(refresh_cache=fresh).submit(variant, config, s) for s in config.suites}
    return serving, suites


def _gather_measure(cluster: ray_cluster.Cluster, variant: Variant, config: MeasureConfig, parts: tuple,
                    memory_bytes: int | None) -> Measured:
    """The parts as one `Measured`, as `measure` returns it (metrics, eval directory, artifacts in its order); a
    cached part whose files were removed is done again."""
    serving, suites = parts
    served = serving.result()
    if not Path(served.bench_json).is_file():
        note(f"the cached serving measurement of {variant.name} lost its files: measuring again")
        with ray_cluster.task_options(cluster, memory_bytes):
            served = measure_serving.with_options(refresh_cache=True).submit(variant, config).result()
    eval_dir = Path(served.eval_dir)
    for suite, future in suites.items():
        done = Path(future.result())
        if not (done / "summary.json").is_file():
            note(f"the cached {suite} results of {variant.name} lost their files ({done}): evaluating again")
            with ray_cluster.task_options(cluster, memory_bytes):
                evaluate_suite.with_options(refresh_cache=True).submit(variant, config, suite).result()
    metrics = {**served.metrics, **measuring.eval_metrics(eval_dir, config.suites)}
    artifacts = [served.bench_json] + [str(eval_dir / s) for s in config.suites] + served.artifacts[1:]
    return Measured(variant=variant, metrics=metrics, eval_dir=str(eval_dir), bench_json=served.bench_json,
                    artifacts=artifacts)
