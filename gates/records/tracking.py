"""Recording a release in MLflow: one experiment per source model, one parent run per release, one
nested run per variant (the baseline included), each variant registered as a model version.

The flow calls, in order:

    release = start_release("smollm2-135m", source_hash, config={"eval": {...}})
    log_variant(release, "baseline", params={...}, metrics={...}, artifacts=[...], manifest=None)
    run = log_variant(release, "int8", params={"method": "int8", "bits": 8}, metrics={...},
                      artifacts=[Path("samples.jsonl"), Path("plots/")], manifest=json.load(...))
    version = register_variant(run)                  # -> "1" in registered model "smollm2-135m-quantgate"
    end_release(release)

Metric names follow `gates.metric_names`. Default store: sqlite under `quantgate.env.home()/mlflow`, so
`mlflow ui --backend-store-uri <tracking_uri()>` shows the runs; `MLFLOW_TRACKING_URI` overrides it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gates.metric_names import EVIDENCE_DIR, check_metrics, stage_tag
from quantgate.env import apply_defaults, home

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

# Run tags written by quantgate (dotted keys need backticks in MLflow filter strings).
TAG_KIND = "quantgate.kind"  # "release" | "variant"
TAG_ROLE = "quantgate.role"  # "baseline" | "variant"
TAG_MODEL = "quantgate.model"
TAG_VARIANT = "quantgate.variant"
TAG_RELEASE = "quantgate.release_run_id"
TAG_SOURCE_HASH = "quantgate.source_hash"
TAG_PARENT = "mlflow.parentRunId"  # what the MLflow UI nests runs by

# The MLflow UI (3.x) opens an experiment of this kind on its runs table ("Machine learning"), not on the
# GenAI traces page it infers for experiments without the tag (the values are the UI's ExperimentKind).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
WEIGHTS_PATH_TAG = "weights_path"  # model-version tags: the weights on disk, and on which host
WEIGHTS_HOST_TAG = "weights_host"

BASELINE = "baseline"
MANIFEST_DIR = "variant"  # the variant's quantgate.json lands at <run artifacts>/variant/quantgate.json
LIBRARIES = ("torch", "transformers", "bitsandbytes", "optimum", "lm_eval", "mlflow", "prefect", "quantgate")
_PARAM_MAX = 6000
_NAME_RE = re.compile(r"^[A-Za-z0-9_\-.]+$")


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` when set, else the sqlite store under quantgate's home."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    return f"sqlite:///{(home() / 'mlflow' / 'mlflow.db').resolve()}"


def artifact_root() -> Path:
    return home() / "mlflow" / "artifacts"


def is_local_store(uri: str | None = None) -> bool:
    uri = uri or tracking_uri()
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


def get_client() -> MlflowClient:
    apply_defaults()
    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=os.environ.get("MLFLOW_REGISTRY_URI") or uri)


def experiment_name(model_name: str) -> str:
    return f"quantgate/{check_name(model_name, 'model name')}"


def check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{what} {name!r} must be letters, digits, '_', '-', '.' only")
    return name


def ensure_experiment(model_name: str, client: MlflowClient | None = None) -> str:
    """The experiment id for this source model, created on first use."""
    client = client or get_client()
    name = experiment_name(model_name)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage != "active":
            raise ValueError(f"MLflow experiment {name!r} is deleted; restore it in the MLflow UI first")
        if experiment.tags.get(EXPERIMENT_KIND_TAG) is None:
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id
    location = None
    if is_local_store():
        location = (artifact_root() / model_name).resolve().as_uri()
    tags = {TAG_MODEL: model_name, EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, artifact_location=location, tags=tags)
    except MlflowException as err:  # two releases of a new model at once: the other one created it first
        experiment = client.get_experiment_by_name(name)
        if err.error_code != "RESOURCE_ALREADY_EXISTS" or experiment is None:
            raise
        return experiment.experiment_id


def library_versions() -> dict[str, str]:
    versions = {}
    for lib in LIBRARIES:
        try:
            versions[f"lib/{lib}"] = importlib.metadata.version(lib.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[f"lib/{lib}"] = "absent"
    return versions


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts become dotted keys; lists and other values become their JSON/str form."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, prefix=f"{full}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
        if len(text) > _PARAM_MAX:
            raise ValueError(f"param {full!r} is {len(text)} characters (MLflow keeps at most {_PARAM_MAX})")
        flat[full] = text
    return flat


def log_batch(
    client: MlflowClient,
    run_id: str,
    params: Mapping[str, str] = {},
    metrics: Mapping[str, float] = {},
    tags: Mapping[str, str] = {},
) -> None:
    """Few round trips (each call is one store transaction); MLflow's per-batch limits respected."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    param_list = [Param(k, v) for k, v in params.items()]
    metric_list = [Metric(k, v, now, 0) for k, v in metrics.items()]
    tag_list = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(param_list), 100):
        client.log_batch(run_id, params=param_list[i : i + 100])
    for i in range(0, len(tag_list), 100):
        client.log_batch(run_id, tags=tag_list[i : i + 100])
    for i in range(0, len(metric_list), 1000):
        client.log_batch(run_id, metrics=metric_list[i : i + 1000])


def start_release(model_name: str, source_hash: str, config: Mapping[str, Any] | None = None) -> str:
    """Open the parent run of one release of `model_name`; returns its run id.

    `config` (eval config, policy path, ...) is logged flattened as params and whole as `config.json`.
    The run's tags name the process running the release (`gates.records.orphans`), set with the run itself.
    """
    from gates.records.release_process import ReleaseProcess

    client = get_client()
    experiment_id = ensure_experiment(model_name, client)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    tags = {TAG_KIND: "release", TAG_MODEL: model_name, TAG_SOURCE_HASH: source_hash,
            **ReleaseProcess.current().tags()}
    run = client.create_run(experiment_id, run_name=f"release-{stamp}", tags=tags)
    run_id = run.info.run_id
    config = dict(config or {})
    log_batch(client, run_id, params={"source_hash": source_hash, **library_versions(), **flatten_params(config)})
    client.log_dict(run_id, {"model": model_name, "source_hash": source_hash, "config": config}, "config.json")
    return run_id


def end_release(release_run_id: str, status: str = "FINISHED") -> None:
    get_client().set_terminated(release_run_id, status=status)


def get_run(run_id: str, client: MlflowClient | None = None) -> Run:
    from mlflow.exceptions import MlflowException

    client = client or get_client()
    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        raise ValueError(f"no MLflow run {run_id!r} in {tracking_uri()}") from exc


def release_children(release_run_id: str, client: MlflowClient | None = None) -> list[Run]:
    """The variant runs (baseline included) nested under a release run, oldest first.

    Runs that failed while being recorded are left out, so a retried flow task can record them again.
    """
    client = client or get_client()
    release = get_run(release_run_id, client)
    runs = client.search_runs(
        [release.info.experiment_id],
        filter_string=f"tags.`{TAG_RELEASE}` = '{release_run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=1000,
    )
    return [run for run in runs if run.info.status not in ("FAILED", "KILLED")]


def find_variant_run(release_run_id: str, variant_name: str, client: MlflowClient | None = None) -> Run | None:
    for run in release_children(release_run_id, client):
        if run.data.tags.get(TAG_VARIANT) == variant_name:
            return run
    return None


def baseline_run(run_id: str, client: MlflowClient | None = None) -> Run | None:
    """The baseline run of the release that `run_id` (a variant run or the release run) belongs to."""
    client = client or get_client()
    run = get_run(run_id, client)
    release_id = run.data.tags.get(TAG_RELEASE, run_id)
    for child in release_children(release_id, client):
        if child.data.tags.get(TAG_ROLE) == BASELINE:
            return child
    return None


def log_variant(
    release_run_id: str,
    variant_name: str,
    params: Mapping[str, Any],
    metrics: Mapping[str, float],
    artifacts: Iterable[Path] = (),
    manifest: Mapping[str, Any] | None = None,
    role: str | None = None,
) -> str:
    """Record one variant of a release as a nested, finished run; returns its run id.

    `variant_name == "baseline"` (or `role="baseline"`) marks the reference every gate compares to.
    Files in `artifacts` go to `evidence/<name>`, folders to `evidence/<folder name>/`; `manifest` (the
    variant's quantgate.json) to `variant/quantgate.json`. Metric keys: see `gates.metric_names`.
    """
    check_name(variant_name, "variant name")
    role = role or (BASELINE if variant_name == BASELINE else "variant")
    if role not in (BASELINE, "variant"):
        raise ValueError(f"role must be 'baseline' or 'variant', not {role!r}")
    clean_metrics = check_metrics(metrics)
    paths = [Path(p) for p in artifacts]
    for path in paths:
        if not path.exists():
            raise ValueError(f"artifact {path} does not exist")
    client = get_client()
    release = get_run(release_run_id, client)
    if release.data.tags.get(TAG_KIND) != "release":
        raise ValueError(f"run {release_run_id} is not a quantgate release run (start_release makes one)")
    if find_variant_run(release_run_id, variant_name, client) is not None:
        raise ValueError(f"release {release_run_id} already has a run for variant {variant_name!r}")
    if role == BASELINE and baseline_run(release_run_id, client) is not None:
        raise ValueError(f"release {release_run_id} already has a baseline run")
    model = release.data.tags[TAG_MODEL]
    source_hash = release.data.tags.get(TAG_SOURCE_HASH, "")
    tags = {
        TAG_PARENT: release_run_id,
        TAG_RELEASE: release_run_id,
        TAG_KIND: "variant",
        TAG_ROLE: role,
        TAG_MODEL: model,
        TAG_VARIANT: variant_name,
        TAG_SOURCE_HASH: source_hash,
    }
    run = client.create_run(release.info.experiment_id, run_name=variant_name, tags=tags)
    run_id = run.info.run_id
    try:
        flat = {"source_hash": source_hash, **library_versions(), **flatten_params(params)}
        log_batch(client, run_id, params=flat, metrics=clean_metrics)
        for path in paths:
            if path.is_dir():
                client.log_artifacts(run_id, str(path), f"{EVIDENCE_DIR}/{path.name}")
            else:
                client.log_artifact(run_id, str(path), EVIDENCE_DIR)
        if manifest is not None:
            client.log_dict(run_id, dict(manifest), f"{MANIFEST_DIR}/quantgate.json")
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def log_metrics(run_id: str, metrics: Mapping[str, float]) -> None:
    """Add measurements to an existing run (e.g. the canary stage's `canary/*` metrics)."""
    clean = check_metrics(metrics)
    client = get_client()
    get_run(run_id, client)
    log_batch(client, run_id, metrics=clean)


def log_evidence(run_id: str, paths: Iterable[Path], subdir: str = EVIDENCE_DIR) -> None:
    client = get_client()
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"artifact {path} does not exist")
        if path.is_dir():
            client.log_artifacts(run_id, str(path), f"{subdir}/{path.name}")
        else:
            client.log_artifact(run_id, str(path), subdir)


def registered_model_name(model_name: str) -> str:
    return f"{model_name}-quantgate"


def register_variant(
    run_id: str,
    registered_model: str | None = None,
    tags: Mapping[str, str] | None = None,
    source: str | Path | None = None,
) -> str:
    """Register a variant run as a new version of `<model>-quantgate`; returns the version string.

    `source` defaults to the run's `variant/` artifact folder (where its quantgate.json was logged);
    pass the variant's directory to point the version at the weights on disk instead. Version tags:
    variant, method (from the run's `method` param), source hash, verdict ("pending" until gates run).
    """
    from mlflow.exceptions import MlflowException

    client = get_client()
    run = get_run(run_id, client)
    if run.data.tags.get(TAG_KIND) != "variant":
        raise ValueError(f"run {run_id} is not a quantgate variant run (log_variant makes one)")
    name = registered_model or registered_model_name(run.data.tags[TAG_MODEL])
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, tags={TAG_MODEL: run.data.tags[TAG_MODEL]})
    weights: dict[str, str] = {}
    if source is None:
        source = f"{run.info.artifact_uri}/{MANIFEST_DIR}"
    elif isinstance(source, Path) or "://" not in str(source):
        source = str(Path(source).expanduser().resolve())
        if not is_local_store():  # a tracking server accepts no local path as a version's source
            weights = {WEIGHTS_PATH_TAG: source, WEIGHTS_HOST_TAG: socket.gethostname()}
            source = f"{run.info.artifact_uri}/{MANIFEST_DIR}"
    version_tags = {
        **weights,
        "variant": run.data.tags.get(TAG_VARIANT, ""),
        "role": run.data.tags.get(TAG_ROLE, ""),
        "method": run.data.params.get("method", ""),
        "source_hash": run.data.tags.get(TAG_SOURCE_HASH, ""),
        "verdict": run.data.tags.get(stage_tag("release", "verdict"), "pending"),
        **dict(tags or {}),
    }
    version = client.create_model_version(name, source=str(source), run_id=run_id, tags=version_tags)
    return str(version.version)


def version_weights(version) -> str:
    """Where a registered version's weights are: its `weights_path` tag (versions registered through a
    tracking server, on the host in `weights_host`), else its source (a local store takes the path)."""
    return version.tags.get(WEIGHTS_PATH_TAG) or str(version.source).removeprefix("file://")


def ui_command(host: str = "127.0.0.1", port: int = 5000, workers: int = 1, verb: str = "ui") -> list[str]:
    """The `mlflow ui` (or `mlflow server`) command that shows this store's runs side by side."""
    import sys

    uri = tracking_uri()
    command = [sys.executable, "-m", "mlflow", verb, "--backend-store-uri", uri]
    if is_local_store(uri):
        artifact_root().mkdir(parents=True, exist_ok=True)
        command += ["--default-artifact-root", artifact_root().resolve().as_uri()]
    return command + ["--host", host, "--port", str(port), "--workers", str(workers)]


def ui_env() -> dict[str, str]:
    """Environment for that command: quiet, offline, and without MLflow's GenAI job runner processes."""
    apply_defaults()
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")}
