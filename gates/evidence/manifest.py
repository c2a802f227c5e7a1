"""A release's evidence bundle: one manifest binding what was released to how it was judged.

For every run of the release (the baseline and each variant): the weight files' sha256 (the directory the
run measured, or the registered version's), the quantization recipe (the variant's `quantgate.json`),
the run's metrics, the sha256 of each per-item output line of every eval task (`evidence/<suite>/samples/
<task>.jsonl`), every gate's verdict per stage with its CI (and whatever else `gates.json` recorded for
it, e.g. power), and the registered version's approval (who, when). Release-wide: the source's content
hash, the policies' text and sha256, the sha256 of the eval data files the tasks read, library versions.

Written on the release run as `evidence/manifest.json` (canonical JSON: the bytes hashed and signed) and,
`evidence/signature.json` (an ed25519 signature when `QUANTGATE_SIGNING_KEY` names a key, else a record
saying "none", which replaces any older signature of a manifest written again); each registered version's
description becomes a model card naming the manifest's sha256. `gates.evidence.verify` re-checks all of it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gates import metric_names as M
from gates.records.tracking import (
    TAG_MODEL,
    TAG_ROLE,
    TAG_SOURCE_HASH,
    TAG_VARIANT,
    get_client,
    get_run,
    release_children,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

KIND = "quantgate-evidence"
FORMAT_VERSION = 1
MANIFEST_PATH = "evidence/manifest.json"
READABLE_NAME = "manifest.pretty.json"  # beside it: the same JSON indented, not hashed
SIGNATURE_PATH = "evidence/signature.json"
CARD_SHA_TAG = "evidence.manifest_sha256"
CARD_RUN_TAG = "evidence.release_run_id"
ERROR_TAG = "evidence.error"  # on a release run whose evidence could not be written: why
SAMPLES_DIR = "samples"
_CARD_MAX = 4900  # MLflow keeps 5000 characters of a version's description


@dataclass(frozen=True)
class Written:
    release_run_id: str
    manifest_sha256: str
    key_id: str | None  # the signing key's id; None: unsigned
    versions: list[str]


def canonical(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes as stored, hashed and signed: sorted keys, no spaces, UTF-8."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- what is hashed (shared with gates.evidence.verify) ------------------------------------------------------


def directory_hashes(directory: Path) -> dict[str, str]:
    """Every file under a model directory (hidden ones aside), relative path -> sha256."""
    from quantgate.models import file_sha256

    directory = Path(directory)
    return {str(p.relative_to(directory)): file_sha256(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)}


def item_hashes(path: Path) -> list[str]:
    """One sha256 per line of a per-sample log: what each item produced, in doc order."""
    return [sha256(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


def output_hashes(evidence_dir: Path | None) -> dict[str, dict[str, Any]]:
    """Per-sample logs under a run's downloaded `evidence/` folder: `<suite>/samples/<task>.jsonl` ->
    the file's sha256 and each item's."""
    if evidence_dir is None or not evidence_dir.is_dir():
        return {}
    out = {}
    for path in sorted(evidence_dir.glob(f"*/{SAMPLES_DIR}/*.jsonl")):
        out[str(path.relative_to(evidence_dir))] = {"sha256": sha256(path.read_bytes()), "items": item_hashes(path)}
    return out


def artifact_hashes(evidence_dir: Path | None) -> dict[str, str]:
    """Every file a run recorded under `evidence/` (comparison, serving report, plots...) -> sha256."""
    if evidence_dir is None or not evidence_dir.is_dir():
        return {}
    return {str(p.relative_to(evidence_dir)): sha256(p.read_bytes()) for p in sorted(evidence_dir.rglob("*"))
            if p.is_file()}


def release_artifacts(client: MlflowClient, run_id: str, work: Path) -> dict[str, str]:
    """The release run's own records (config.json, summary.json, summary.md...) -> sha256; not `evidence/`."""
    out = {}
    for info in client.list_artifacts(run_id):
        if info.path == "evidence":
            continue
        path = download(client, run_id, info.path, work)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out.update({str(f.relative_to(work)): sha256(f.read_bytes()) for f in files})
    return out


def task_of(output: str) -> str:
    return Path(output).stem


def data_files(task: str) -> list[Path] | None:
    """The data files an eval task reads (its lm-eval config's `data_files`); None for a name that is
    not one of quantgate's tasks."""
    from evals.tasks import lm_eval_config, resolve_tasks

    try:
        (spec,) = resolve_tasks([task])
    except ValueError:
        return None
    files = lm_eval_config(spec).get("dataset_kwargs", {}).get("data_files", {})
    paths: list[Path] = []
    for value in files.values():
        paths += [Path(v) for v in (value if isinstance(value, list) else [value])]
    return sorted(set(paths))


def data_hashes(tasks: set[str]) -> dict[str, dict[str, str] | None]:
    """task -> {data file: sha256}; None where the task is not quantgate's or its files cannot be read here."""
    from quantgate.models import file_sha256

    out: dict[str, dict[str, str] | None] = {}
    for task in sorted(tasks):
        try:
            files = data_files(task)
            out[task] = None if files is None else {str(p): file_sha256(p) for p in files}
        except OSError:
            out[task] = None
    return out


def gate_ci(name: str, metrics: dict[str, float]) -> list[float] | None:
    """The CI a gate judged, from the run's metrics (task deltas, speed ratios); None for point gates."""
    parts = name.split("/")
    if parts[0] == "task" and len(parts) == 3:
        keys = (M.task_delta_ci_low(parts[1]), M.task_delta_ci_high(parts[1]))
    elif name.startswith("serve/min_decode_speedup/b"):
        base = M.decode_speedup(int(name.rsplit("/b", 1)[1]))
        keys = (M.ci(base, "ci_low"), M.ci(base, "ci_high"))
    else:
        base = {"serve/min_prefill_speedup": M.SERVE_PREFILL_SPEEDUP,
                "canary/min_tpot_speedup": M.CANARY_TPOT_SPEEDUP}.get(name)
        if base is None:
            return None
        keys = (M.ci(base, "ci_low"), M.ci(base, "ci_high"))
    return [metrics[keys[0]], metrics[keys[1]]] if all(k in metrics for k in keys) else None


def download(client: MlflowClient, run_id: str, path: str, dst: Path) -> Path | None:
    """A run's artifact (file or folder) under `dst`; None when the run has none at `path`."""
    parent = str(Path(path).parent) if "/" in path else None
    if path not in {f.path for f in client.list_artifacts(run_id, parent)}:
        return None
    dst.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst)))


def weights_dir(client: MlflowClient, run: Run) -> tuple[str | None, str | None]:
    """(registered version, weights directory) of a run: the version's weights when it was registered,
    else the directory the run measured (its `variant_path` param)."""
    from gates.records.tracking import version_weights

    versions = client.search_model_versions(f"run_id = '{run.info.run_id}'")
    if versions:
        mv = max(versions, key=lambda v: int(v.version))
        return str(mv.version), version_weights(mv)
    return None, run.data.params.get("variant_path")


def gate_records(client: MlflowClient, run: Run, metrics: dict[str, float], work: Path) -> dict[str, Any]:
    """Every stage's recorded evaluation: verdict, policy, and each gate (gates.json's fields + its CI)."""
    from gates.records.evaluation import read_evaluation

    out = {}
    for stage in M.STAGES:
        evaluation = read_evaluation(run.info.run_id, stage, client)
        if evaluation is None:
            continue
        path = download(client, run.info.run_id, f"gates/{stage}/gates.json", work / stage)
        raw = json.loads(path.read_text()) if path else {}
        results = raw.get("results") or [asdict(r) for r in evaluation.results]
        out[stage] = {
            "verdict": evaluation.extra.get("verdict", ""),
            "evaluated_at": evaluation.evaluated_at,
            "policy_sha256": evaluation.policy_sha256,
            "baseline_run_id": evaluation.baseline_run_id,
            "gates_json_sha256": sha256(path.read_bytes()) if path else None,
            "gates": [{**r, "ci": gate_ci(r["name"], metrics)} for r in results],
        }
    return out


def policy_texts(client: MlflowClient, run: Run, stages: dict[str, Any], work: Path) -> dict[str, dict]:
    """sha256 -> {source, text} of each policy a stage was judged by (its recorded `policy.yaml`)."""
    out = {}
    for stage in stages:
        path = download(client, run.info.run_id, f"gates/{stage}/policy.yaml", work / stage)
        if path is not None:
            text = path.read_bytes().decode()
            out[sha256(text.encode())] = {"source": run.data.tags.get(M.stage_tag(stage, "policy_source"), ""),
                                          "text": text}
    return out


# ---- building and writing ---------------------------------------------------------------------------


def _run_entry(client: MlflowClient, run: Run, work: Path) -> tuple[dict[str, Any], dict[str, dict]]:
    from gates.metric_names import EVIDENCE_DIR
    from gates.records.registry import read_approval
    from gates.records.tracking import MANIFEST_DIR

    run_id = run.info.run_id
    metrics = dict(run.data.metrics)
    version, weights = weights_dir(client, run)
    recipe_path = download(client, run_id, f"{MANIFEST_DIR}/quantgate.json", work / "recipe")
    stages = gate_records(client, run, metrics, work / "gates")
    evidence = download(client, run_id, EVIDENCE_DIR, work / "outputs")
    approval = read_approval(run.data.tags[TAG_MODEL], version) if version else None
    entry = {
        "name": run.data.tags.get(TAG_VARIANT, ""),
        "role": run.data.tags.get(TAG_ROLE, ""),
        "run_id": run_id,
        "registered_version": version,
        "kv_cache_dtype": run.data.params.get("kv_cache_dtype", "auto"),
        "weights": {"path": weights, "files": directory_hashes(Path(weights)) if weights and Path(weights).is_dir()
                    else None},
        "recipe": json.loads(recipe_path.read_text()) if recipe_path else None,
        "metrics": metrics,
        "outputs": output_hashes(evidence),
        "artifacts": artifact_hashes(evidence),
        "stages": stages,
        "approval": asdict(approval) if approval else None,
    }
    if entry["weights"]["path"] and entry["weights"]["files"] is None:
        raise ValueError(f"run {run_id} ({entry['name']}): weights directory {weights} is gone; nothing to hash")
    return entry, policy_texts(client, run, stages, work / "policy")


def build_manifest(release_run_id: str, client: MlflowClient | None = None) -> dict[str, Any]:
    """The manifest of a recorded release (read from MLflow and the weights on disk)."""
    from gates.records.tracking import library_versions

    client = client or get_client()
    release = get_run(release_run_id, client)
    if release.data.tags.get("quantgate.kind") != "release":
        raise ValueError(f"run {release_run_id} is not a quantgate release run")
    runs, policies = [], {}
    with tempfile.TemporaryDirectory(prefix="quantgate-evidence-") as tmp:
        for i, run in enumerate(release_children(release_run_id, client)):
            entry, found = _run_entry(client, run, Path(tmp) / str(i))
            runs.append(entry)
            policies.update(found)
        records = release_artifacts(client, release_run_id, Path(tmp) / "release")
    tasks = {task_of(o) for r in runs for o in r["outputs"]}
    return {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "release_run_id": release_run_id,
        "model": release.data.tags.get(TAG_MODEL, ""),
        "source_hash": release.data.tags.get(TAG_SOURCE_HASH, ""),
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        "approval": {k.removeprefix("approval."): v for k, v in release.data.tags.items()
                     if k.startswith("approval.")},
        "release_artifacts": records,
        "policies": policies,
        "eval_data": data_hashes(tasks),
        "runs": runs,
        "libraries": library_versions(),
    }


def write_evidence(release_run_id: str, signing_key: Path | None = None,
                   client: MlflowClient | None = None) -> Written:
    """Build, sign (when a key is given or configured) and record a release's manifest and model cards."""
    from gates.evidence import signing
    from quantgate import settings

    client = client or get_client()
    key_path = signing_key or settings.key_path(settings.SIGNING_KEY)
    private = signing.load_private_key(key_path) if key_path else None  # a bad key fails before anything
    manifest = build_manifest(release_run_id, client)
    payload = canonical(manifest)
    digest = sha256(payload)
    signature = signing.sign(payload, private) if private else None
    with tempfile.TemporaryDirectory(prefix="quantgate-evidence-") as tmp:
        folder = Path(tmp) / "evidence"
        folder.mkdir()
        (folder / "manifest.json").write_bytes(payload)
        # The same manifest indented for people reading it in the MLflow UI; only the canonical bytes above
        # are hashed, signed and verified (one 256 KB line is unreadable in the artifact viewer).
        (folder / READABLE_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                                            encoding="utf-8")
        record = signature or signing.NO_SIGNATURE
        (folder / "signature.json").write_text(json.dumps(record.as_dict(), indent=2) + "\n")
        client.log_artifacts(release_run_id, str(folder), "evidence")
    client.set_tag(release_run_id, CARD_SHA_TAG, digest)
    versions = []
    for run in manifest["runs"]:
        if run["registered_version"]:
            name = _registered_name(client, run["run_id"], run["registered_version"])
            card = model_card(manifest, run, digest, signature.key_id if signature else None)
            client.update_model_version(name, run["registered_version"], description=card)
            client.set_model_version_tag(name, run["registered_version"], CARD_SHA_TAG, digest)
            client.set_model_version_tag(name, run["registered_version"], CARD_RUN_TAG, release_run_id)
            versions.append(run["registered_version"])
    return Written(release_run_id, digest, signature.key_id if signature else None, versions)


def _registered_name(client: MlflowClient, run_id: str, version: str) -> str:
    for mv in client.search_model_versions(f"run_id = '{run_id}'"):
        if str(mv.version) == str(version):
            return mv.name
    raise ValueError(f"run {run_id} has no registered version {version}")


def model_card(manifest: dict[str, Any], run: dict[str, Any], digest: str, key_id: str | None) -> str:
    """The registered version's description: what it is, how it was judged, and how to check it."""
    recipe = run["recipe"] or {}
    weights = run["weights"]["files"] or {}
    lines = [
        f"# {manifest['model']} {run['name']} (v{run['registered_version']})",
        "",
        f"- evidence: `{MANIFEST_PATH}` of release run `{manifest['release_run_id']}`, sha256 `{digest}`",
        f"- signature: {'ed25519 key ' + key_id if key_id else 'none (unsigned)'}",
        f"- check it: `quantgate verify {manifest['release_run_id']}`",
        f"- source: content hash `{manifest['source_hash']}`",
        f"- weights: {len(weights)} files, sha256 of their table `{sha256(canonical(weights))[:16]}`",
        f"- recipe: {recipe.get('method', 'none (the source weights)')}"
        + (f", options {json.dumps(recipe.get('options'), sort_keys=True)}" if recipe.get("options") else "")
        + f"; KV cache {run['kv_cache_dtype']}",
    ]
    for stage, record in run["stages"].items():
        failed = [g["name"] for g in record["gates"] if not g["passed"]]
        blind = [g["name"] for g in record["gates"] if g.get("verdict") == "uninformative"]
        lines.append(f"- {stage} gates: **{record['verdict']}** ({len(record['gates'])} gates; policy sha256 "
                     f"`{record['policy_sha256'][:16]}`)" + (f"; failed: {', '.join(failed)}" if failed else "")
                     + (f"; uninformative: {', '.join(blind)}" if blind else ""))
    approval = run["approval"]
    lines.append(f"- approval: {approval['decision']} by {approval['by']} at {approval['at']}" if approval
                 else "- approval: none recorded")
    card = "\n".join(lines) + "\n"
    return card if len(card) <= _CARD_MAX else card[: _CARD_MAX - 20] + "\n… (see manifest)\n"
