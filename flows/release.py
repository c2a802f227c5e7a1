"""The release flow: a model changes -> variants -> measured -> recorded -> gated -> approved -> canary.

Every stage is a Prefect task. Quantization, serving benchmarks and evals are cached by content hash
(persisted results under `quantgate.env.home()/flows/results`), so a rerun after a crash resumes from
what finished. Transient failures retry; any stage that still fails ends the flow, the release run is
marked FAILED in MLflow and no alias moves (a challenger set by this run is cleared again).
"""

from __future__ import annotations

import re
from dataclasses import asdict, replace
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from evals.tasks import resolve_tasks
from flows import (
    canary_stage,
    fidelity_stage,
    measuring,
    memory_plan,
    ray_cluster,
    records,
    release_on_ray,
)
from flows.approval import APPROVE_MODES
from flows.data import (
    BASELINE,
    MeasureConfig,
    Measured,
    ReleaseSummary,
    Source,
    SpeedPlan,
    SpeedResult,
    Variant,
    VariantResult,
)
from flows.decision import approve_variants, choose
from flows.machine import resolve_device
from flows.progress import note, stage
from flows.release_tasks import RETRIED, measure, measure_speed, quantize_method, variants_of
from flows.runtime import prepare, work_dir
from flows.stage_process import StageKilled
from gates import metric_names as M
from gates.judging.policy import Policy, load_policy
from gates.records.comparison import log_release_comparison
from gates.records.evaluation import evaluate_run
from gates.records.orphans import TAG_FAILURE, fail_orphaned_releases
from gates.records.registry import clear_challenger, promote, set_challenger
from gates.records.tracking import (
    end_release,
    log_variant,
    register_variant,
    registered_model_name,
    tracking_uri,
)
from gates.records.tracking import start_release as open_release_run
from quantgate.models import DEFAULT_MODEL, is_default_model, resolve_model
from quantize.capacity import split_variant, variant_label
from quantize.methods import default_methods
from quantize.variant import cached_content_hash

FLOW_NAME = "quantgate-release"
def model_name(ref: str, path: Path) -> str:
    """The name a model's experiment and registered model carry: the alias, or the dir/file stem."""
    if is_default_model(ref):
        return DEFAULT_MODEL
    stem = Path(ref).stem if ref.endswith(".gguf") else path.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "model"


def read_policy(policy: str | None) -> Policy:
    """The gate policy, parsed once per run (`policy`: a path, None for gates/policy.yaml); stages get the
    object, and `Policy.source` is the resolved path the run records."""
    return load_policy(Path(policy).expanduser().resolve() if policy else None)


def check_options(methods: list[str], approve: str, limit: int | None, policy: str | None,
                  suites: list[str] | None = None) -> Policy:
    """Bad input fails before anything runs, each problem named; returns the parsed policy."""
    if approve not in APPROVE_MODES:
        raise ValueError(f"approve must be one of {', '.join(APPROVE_MODES)}, not {approve!r}")
    if not methods:
        raise ValueError("at least one quantization method is needed")
    if len({variant_label(m) for m in methods}) != len(methods):
        raise ValueError(f"methods repeat: {methods}")
    measuring.check_methods(methods)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or none for the full suites), got {limit}")
    parsed = read_policy(policy)
    records.check_signing_key()
    if suites is not None:
        if not suites:
            raise ValueError("suites is empty")
        resolve_tasks(list(suites))
    return parsed


# ---- tasks ------------------------------------------------------------------------------------------


@task(name="resolve-source", cache_policy=NO_CACHE)
def resolve_source(ref: str) -> Source:
    with stage(f"resolve {ref}"):
        path = resolve_model(ref)
        digest = cached_content_hash(Path(path))
    note(f"source {ref} -> {path} (sha256 {digest[:12]})")
    return Source(ref=ref, name=model_name(ref, path), path=str(path), content_hash=digest)


@task(name="start-release", cache_policy=NO_CACHE, **RETRIED)
def start_release(source: Source, config: dict) -> str:
    for orphan in fail_orphaned_releases(source.name, found_by=f"the next release of {source.name}"):
        note(f"MLflow release run {orphan} was left RUNNING by a process that is gone: marked FAILED")
    return open_release_run(source.name, source.content_hash, config=config)


@task(name="record", cache_policy=NO_CACHE)
def record(release_run_id: str, measured: Measured, baseline: Measured | None,
           speed: SpeedResult | None = None, register: bool = True) -> tuple[str, str | None]:
    """Compare with the baseline (variants only), log the run in MLflow, register the variant (unless
    `register` is False: `quantgate tune`'s candidates are recorded, never registered)."""
    v = measured.variant
    with stage(f"{v.name}: compare and record in MLflow"):
        metrics = dict(measured.metrics)
        artifacts = [Path(a) for a in measured.artifacts]
        if speed is not None:
            metrics.update(speed.metrics.get(v.name, {}))
            artifacts += [Path(speed.report)] if Path(speed.report).is_file() else []
        if baseline is not None:
            cmp_dir = work_dir("compare", release_run_id, v.name)
            cmp_metrics, cmp_artifacts = measuring.compare(Path(baseline.eval_dir), Path(measured.eval_dir), v.name,
                                                             cmp_dir)
            metrics.update(cmp_metrics)
            metrics.update(measuring.capacity_gain(measured.metrics, baseline.metrics))
            artifacts += cmp_artifacts
        params = {
            "method": v.method or "none",
            "kv_cache_dtype": v.kv_cache_dtype,
            "variant_path": v.path,
            "variant_hash": v.content_hash,
            **({"bits": v.manifest.get("bits")} if v.manifest and v.manifest.get("bits") is not None else {}),
        }
        run_id = log_variant(release_run_id, v.name, params=params, metrics=metrics, artifacts=artifacts,
                             manifest=v.manifest)
        if speed is not None:
            records.tag_release(run_id, {M.MACHINE_TAG: speed.machine[:5000]})
        version = register_variant(run_id, source=v.path) if baseline is not None and register else None
    return run_id, version


@task(name="evaluate-gates", cache_policy=NO_CACHE, **RETRIED)
def evaluate_gates(run_id: str, policy: Policy, stage_name: str = "release"):
    return evaluate_run(run_id, policy, stage=stage_name)


@task(name="canary", cache_policy=NO_CACHE)
def canary(champion_dir: str, challenger_dir: str, requests: int, share: float, out: str, release_run_id: str,
           challenger_run_id: str, policy: Policy, kv_cache_dtypes: dict[str, str] | None = None,
           backend: str = "local", device: str = "cpu") -> dict:
    """Replay traffic through the router; the challenger's numbers go to MLflow and are judged there
    (canary gates) before the router is told to promote or roll back."""
    def judge(result: dict) -> tuple[bool, str]:
        records.record_canary_metrics(release_run_id, challenger_run_id, result)
        ev = evaluate_run(challenger_run_id, policy, stage="canary")
        result["gates"] = {"passed": ev.passed, "failed": [r.name for r in ev.failed]}
        if ev.passed:
            return True, f"canary gates passed ({len(ev.results)} gates), MLflow run {challenger_run_id}"
        return False, "canary gates failed: " + "; ".join(f"{r.name}: {r.reason}" for r in ev.failed)

    with stage(f"canary: {requests} replayed requests, {share:.0%} to the challenger", total=requests) as advance:
        result = canary_stage.run_canary(Path(champion_dir), Path(challenger_dir), requests, share, Path(out),
                                         advance, judge, kv_cache_dtypes, backend, device)
    parts = result["seconds"]
    note(f"canary: both versions up in {parts['up']:.1f} s, {requests} requests replayed in {parts['replay']:.1f} s, "
         f"gates judged in {parts['judge']:.1f} s, servers down in {parts['down']:.1f} s")
    records.log_canary_artifacts(challenger_run_id, result)
    return result


# ---- the flow ---------------------------------------------------------------------------------------


@flow(name=FLOW_NAME, log_prints=True, validate_parameters=True)
def release_flow(
    model: str = DEFAULT_MODEL,
    methods: list[str] | None = None,
    policy: str | None = None,
    approve: str = "auto",
    limit: int | None = None,
    suites: list[str] | None = None,
    approval_timeout_s: int = 24 * 3600,
    canary_requests: int = 24,
    canary_share: float = 0.5,
    canary_backend: str = "local",
    fresh: bool = False,
    device: str | None = None,
    ray_address: str | None = None,
) -> dict:
    """Quantize `model`, measure every variant against the baseline, gate, approve, canary, promote.
    `device`: where every model is served (None: QUANTGATE_DEVICE, else CUDA when present, else CPU); it
    picks the default `methods` (quantize/methods.py) and is part of every measurement's key.
    `ray_address`: a Ray cluster (`host:port`, or `auto`) that quantizes, measures and evaluates every model,
    one task per quantization, per model's serving measurement and per model and suite, through prefect-ray's
    RayTaskRunner; the paired speed rounds and the canary stay in this process (flows/ray_cluster.py). None: all
    of it here, one stage after another."""
    # The deployment's entrypoint: a flow-run process a worker starts enters here, not through the CLI, so
    # quantgate's defaults are set here for what the run reads and starts later (MLflow, canary servers;
    # setdefault, idempotent). Prefect's own settings were read when this process imported Prefect: on a work
    # pool they come from the deployment's job variables (runtime.deployment_env, flows/README.md).
    prepare()
    device = resolve_device(device)
    methods = list(methods or default_methods(device))
    pol = check_options(methods, approve, limit, policy, suites)
    config = replace(fidelity_stage.measure_config(pol, methods, suites, limit), device=device)
    source = resolve_source(model)
    mem = memory_plan.for_release(source.path, methods, config, pol)  # config.json only: no model loaded
    config = replace(config, capacity_budget_gb=mem.capacity_budget_gb)  # never a budget the weights fill
    cluster = release_on_ray.connect(ray_address, device, mem) if ray_address else None  # refused before any run
    run_config = {"methods": methods, "approve": approve, "policy": pol.source,
                  "device": device, "measure": asdict(config), "prefect_flow_run_id": str(flow_run.id),
                  **({"ray_address": ray_address} if ray_address else {})}
    try:
        release_id = start_release(source, run_config)
    except BaseException:
        if cluster is not None:
            ray_cluster.disconnect()
        raise
    summary = ReleaseSummary(
        model=source.name, source_hash=source.content_hash, release_run_id=release_id,
        flow_run_id=str(flow_run.id), tracking_uri=tracking_uri(),
        registered_model=registered_model_name(source.name), rows=[],
    )
    note(f"MLflow release run {release_id}; Prefect flow run {flow_run.id}")
    moved_challenger = None
    try:
        baseline_variant = Variant(BASELINE, None, source.path, source.content_hash, None)
        variants, base, measured = _build_and_measure(source, methods, config, fresh, mem, cluster, release_id)
        plan = SpeedPlan.from_policy(pol, device)
        speed = measure_speed.with_options(refresh_cache=fresh)([baseline_variant, *variants], plan)
        summary.machine = speed.machine if cluster is None else f"{speed.machine}; on {cluster.driver}"

        base_run, _ = record(release_id, base, None, speed)
        summary.rows.append(VariantResult(BASELINE, None, base_run, weight_bytes=base.metrics.get(M.WEIGHTS_BYTES),
                                          decision="reference"))
        for m in measured:
            run_id, version = record(release_id, m, base, speed)
            ev = evaluate_gates(run_id, pol)
            summary.rows.append(VariantResult(
                m.variant.name, m.variant.method, run_id, version, m.metrics.get(M.WEIGHTS_BYTES),
                gates_passed=ev.passed, gates_total=len(ev.results), gates_failed=[r.name for r in ev.failed],
                gates_uninformative=[r.name for r in ev.uninformative],
                gates_reasons={r.name: r.reason for r in ev.failed},
            ))
        log_release_comparison(release_id)
        champion = records.champion_or_baseline(summary, source)  # the first release makes the baseline champion

        candidates = [r.name for r in summary.rows if r.gates_passed]
        decision = approve_variants(summary, candidates, approve, approval_timeout_s)
        chosen = choose(summary, decision)
        if chosen is None:
            summary.outcome = "nothing promoted: no variant passed its gates and was approved"
        else:
            summary.chosen = chosen.name
            summary.challenger_version = chosen.version
            moved_challenger = chosen.version
            set_challenger(source.name, chosen.version,
                           reason=f"release {release_id}: smallest approved variant ({chosen.name})")
            _canary_stage(summary, source, chosen, champion, pol,
                          (canary_requests, canary_share, canary_backend, device))
            moved_challenger = None
        summary.aliases = records.aliases(source.name)
        records.log_summary(release_id, summary)
        records.write_evidence(release_id)
        end_release(release_id)
    except BaseException as exc:
        if isinstance(exc, StageKilled | memory_plan.MemoryRefused):  # the stage (and its bytes), beside FAILED
            records.tag_release(release_id, {**exc.tags(), TAG_FAILURE: str(exc)})
        if moved_challenger is not None:
            clear_challenger(source.name, reason=f"release {release_id} failed before promotion",
                             version=moved_challenger)
        end_release(release_id, status="FAILED")
        raise
    finally:
        if cluster is not None:
            ray_cluster.disconnect()
    return summary.as_dict()


def _build_and_measure(source: Source, methods: list[str], config: MeasureConfig, fresh: bool,
                       mem: memory_plan.MemoryPlan, cluster: ray_cluster.Cluster | None,
                       release_id: str) -> tuple[list[Variant], Measured, list[Measured]]:
    """Every variant built and every model measured: here, one after another, or on the Ray cluster."""
    if cluster is None:
        mem.check()  # a stage that cannot fit is refused (MemoryRefused) before anything is built
        records.snapshot_first_release(source)
        variants = _quantize_all(source, methods, fresh)
        base = _measure(Variant(BASELINE, None, source.path, source.content_hash, None), config, fresh)
        return variants, base, [_measure(v, config, fresh) for v in variants]
    records.tag_release(release_id, cluster.tags())  # the nodes' room was checked when connecting; the speed
    release_on_ray.driver_stages(mem).check()  # rounds and the canary still run here
    records.snapshot_first_release(source)
    return release_on_ray.build_and_measure(cluster, source, methods, config, fresh, mem)


def _quantize_all(source: Source, methods: list[str], fresh: bool) -> list[Variant]:
    """Quantize each weight method once (int4wo and int4wo+kv8 share the weights); a cached variant whose
    files vanished is rebuilt. A KV suffix only changes how the variant is served and measured.

    Model construction is serialised per process (quantgate.loading), so threads gain nothing here, and a
    process each would pay for its imports again (docs/results/design-figures.md)."""
    task_ = quantize_method.with_options(refresh_cache=True) if fresh else quantize_method
    weights: dict[str, Variant] = {}
    for method in dict.fromkeys(split_variant(m)[0] for m in methods):
        if method == BASELINE:
            weights[method] = Variant(BASELINE, None, source.path, source.content_hash, None)
            continue
        v = task_(source, method)
        if not measuring.variant_intact(Path(v.path)):
            note(f"cached variant {v.name} at {v.path} is gone or damaged: quantizing again")
            v = quantize_method.with_options(refresh_cache=True)(source, method)
        weights[method] = v
    return variants_of(weights, methods)


def _measure(variant: Variant, config: MeasureConfig, fresh: bool) -> Measured:
    """Measure (or take the persisted measurement); a cached one whose files were removed is redone."""
    result = measure.with_options(refresh_cache=fresh)(variant, config)
    if not (Path(result.eval_dir).is_dir() and Path(result.bench_json).is_file()):
        note(f"the cached measurement of {variant.name} lost its files ({result.eval_dir}): measuring again")
        result = measure.with_options(refresh_cache=True)(variant, config)
    return result


def _canary_stage(summary: ReleaseSummary, source: Source, chosen: VariantResult, champion: tuple[str, Path],
                  policy: Policy, plan: tuple[int, float, str, str]) -> None:
    requests, share, backend, device = plan
    champion_version, champion_dir = champion
    challenger_dir = records.version_source(source.name, chosen.version)
    kv = {canary_stage.CHAMPION: records.version_kv_cache_dtype(source.name, champion_version),
          canary_stage.CHALLENGER: records.version_kv_cache_dtype(source.name, chosen.version)}
    out = work_dir("canary", summary.release_run_id)
    result = canary(str(champion_dir), str(challenger_dir), requests, share, str(out), summary.release_run_id,
                    chosen.run_id, policy, kv, backend, device)
    passed, failed = result["gates"]["passed"], result["gates"]["failed"]
    summary.canary = {"champion_version": champion_version, **result["summary"], "passed": passed, "failed": failed}
    if passed:
        promote(source.name, chosen.version,
                reason=f"release {summary.release_run_id}: canary passed against v{champion_version}")
        summary.outcome = f"{chosen.name} (v{chosen.version}) promoted to champion"
        chosen.decision += "; canary passed -> champion"
    else:
        clear_challenger(source.name, reason=f"canary failed: {', '.join(failed)}", version=chosen.version)
        summary.outcome = f"{chosen.name} (v{chosen.version}) rolled back after the canary; champion stays v{champion_version}"
        chosen.decision += "; canary failed -> rolled back"
