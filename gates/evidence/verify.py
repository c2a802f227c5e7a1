"""`quantgate verify RUN_ID`: re-check a release's evidence manifest (gates.evidence.manifest) against what exists now.

Checked: the signature (with the verifier's own key, never one the run carries), the manifest's shape,
that the release still has the runs it names; per run the weight files on disk, the recipe, the metrics
and per-item outputs recorded in MLflow, every stage's recorded verdicts (tags and `gates.json`), the
approval and the model card; release-wide the policies (their text, each variant's recorded copy, and the
file at its source path while it exists), the source hash and the eval data files.

Then the verdicts are re-derived from the evidence, not taken from the manifest's own aggregates: from the
per-item records the hash checks just bound to the manifest (per-sample logs, fidelity.json,
long_context.json, speed.json) `gates.evidence.rederive` recomputes every task, safety, fidelity,
long-context and speed metric with the release's code and seeded resamples (group-sequential speed rounds are
replayed look by look, `gates.evidence.speed_replay`: a point timed past its decision, or ended undecided, is
a mismatch naming its gate); each must equal what the run
recorded (else a mismatch naming the gate), and every gate is judged again (`gates.judging.judge.judge`)
on the recomputed numbers. The report lists which gates were re-derived from items and which (weights,
capacity, latency, canary; any family whose records are absent) could only be hash-checked.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gates.evidence import manifest as E
from gates.evidence import rederive as R
from gates.metric_names import EVIDENCE_DIR
from gates.records.tracking import TAG_RELEASE, get_client, get_run, release_children

if TYPE_CHECKING:
    from mlflow import MlflowClient

_COMPARED = ("verdict", "passed", "threshold", "observed")  # a recorded gate's fields that must match


@dataclass
class Report:
    release_run_id: str
    mismatches: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    authorship: str = ""  # what the signature check established, in words
    rederived: list[str] = field(default_factory=list)  # gates judged again on metrics recomputed from items
    hash_only: list[str] = field(default_factory=list)  # gates whose inputs could only be hash-checked

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def compare(self, what: str, recorded: Any, now: Any) -> bool:
        if _same(recorded, now):
            self.checked.append(what)
            return True
        self.mismatches.append(f"{what}: manifest says {_short(recorded)}, found {_short(now)}")
        return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


def verify(run_id: str, verify_key: Path | None = None, client: MlflowClient | None = None) -> Report:
    """Re-check the evidence of the release `run_id` belongs to (a release or one of its variant runs)."""
    from quantgate import settings

    client = client or get_client()
    run = get_run(run_id, client)
    release_id = run.data.tags.get(TAG_RELEASE, run_id)
    key_path = verify_key or settings.key_path(settings.VERIFY_KEY)
    report = Report(release_id)
    with tempfile.TemporaryDirectory(prefix="quantgate-verify-") as tmp:
        work = Path(tmp)
        path = E.download(client, release_id, E.MANIFEST_PATH, work / "bundle")
        if path is None:
            error = get_run(release_id, client).data.tags.get(E.ERROR_TAG)
            report.mismatches.append(f"release run {release_id} has no {E.MANIFEST_PATH} (no evidence was written"
                                     + (f": {error})" if error else ")"))
            return report
        payload = path.read_bytes()
        sig_path = E.download(client, release_id, E.SIGNATURE_PATH, work / "bundle")
        _check_signature(report, payload, sig_path, key_path)
        try:
            manifest = json.loads(payload)
        except ValueError as exc:
            report.mismatches.append(f"{E.MANIFEST_PATH} is not JSON: {exc}")
            return report
        if manifest.get("kind") != E.KIND or manifest.get("format_version") != E.FORMAT_VERSION:
            report.mismatches.append(f"{E.MANIFEST_PATH} is not a quantgate evidence manifest v{E.FORMAT_VERSION}")
            return report
        try:
            _check_release(report, manifest, client, E.sha256(payload), work)
        except (KeyError, TypeError, AttributeError) as exc:
            report.mismatches.append(f"{E.MANIFEST_PATH} is malformed ({type(exc).__name__}: {exc})")
    return report


def _check_release(report: Report, manifest: dict[str, Any], client: MlflowClient, digest: str, work: Path) -> None:
    release_id = report.release_run_id
    report.compare("manifest release run id", manifest["release_run_id"], release_id)
    release_tags = get_run(release_id, client).data.tags
    report.compare("manifest sha256 on the release run", digest, release_tags.get(E.CARD_SHA_TAG))
    report.compare("release approval", manifest["approval"],
                   {k.removeprefix("approval."): v for k, v in release_tags.items() if k.startswith("approval.")})
    now = E.release_artifacts(client, release_id, work / "release")
    for name in sorted(set(manifest["release_artifacts"]) | set(now)):
        report.compare(f"release run artifact {name}", manifest["release_artifacts"].get(name, "absent"),
                       now.get(name, "absent"))
    _check_policies(report, manifest)
    _check_runs(report, manifest, client, digest, work)
    _check_data(report, manifest)


def _check_signature(report: Report, payload: bytes, sig_path: Path | None, key_path: Path | None) -> None:
    from gates.evidence import signing

    try:
        signature = signing.Signature.from_dict(json.loads(sig_path.read_text())) if sig_path else None
    except ValueError as exc:
        report.mismatches.append(f"signature: unreadable {E.SIGNATURE_PATH}: {exc}")
        signature = None
    signature = signature if signature is not None and signature.signed else None
    if key_path is None:
        report.authorship = ("no verify key configured (QUANTGATE_VERIFY_KEY or --key): only integrity is checked, "
                             "not authorship; whoever can write the run could have rewritten the manifest and "
                             "its signature together")
        if signature is not None:
            report.notes.append(f"the manifest carries a signature by key {signature.key_id}, not checked without "
                                "a verify key")
        return
    public = signing.load_public_key(key_path)
    if signature is None:
        report.mismatches.append(f"signature: the manifest is unsigned, but verify key {key_path} is configured")
        report.authorship = "not established: unsigned"
        return
    problem = signing.check(payload, signature, public)
    if problem:
        report.mismatches.append(f"signature: {problem}")
        report.authorship = f"not established: {problem}"
    else:
        report.authorship = f"signed by the holder of ed25519 key {signing.key_id(public)} ({key_path})"
        report.checked.append("signature")


def _check_policies(report: Report, manifest: dict[str, Any]) -> None:
    for sha, policy in manifest["policies"].items():
        report.compare(f"policy {policy['source']}: sha256 of the recorded text", sha, E.sha256(policy["text"].encode()))
        source = Path(policy["source"])
        if source.is_file():
            report.compare(f"policy file {source}: sha256", sha, E.sha256(source.read_bytes()))
        else:
            report.notes.append(f"policy file {source} is not on this machine; its recorded copy was checked")


def _check_data(report: Report, manifest: dict[str, Any]) -> None:
    from quantgate.models import file_sha256

    for task, files in manifest["eval_data"].items():
        if files is None:
            report.notes.append(f"eval data of {task}: not hashed at release (not a quantgate task, or its files "
                                "were not readable there)")
            continue
        for name, sha in files.items():
            path = Path(name)
            report.compare(f"eval data of {task}: {name}", sha, file_sha256(path) if path.is_file() else "missing")


def _check_runs(report: Report, manifest: dict[str, Any], client: MlflowClient, digest: str, work: Path) -> None:
    runs = {r.info.run_id: r for r in release_children(manifest["release_run_id"], client)}
    report.compare("the release's runs", sorted(e["run_id"] for e in manifest["runs"]), sorted(runs))
    baseline = next((e for e in manifest["runs"] if e["role"] == "baseline"), None)
    evidence = {e["run_id"]: E.download(client, e["run_id"], EVIDENCE_DIR, work / str(i))
                for i, e in enumerate(manifest["runs"]) if e["run_id"] in runs}
    base_evidence = evidence.get(baseline["run_id"]) if baseline else None
    base_derived = R.derive_model(base_evidence) if baseline and baseline["run_id"] in runs else None
    for i, entry in enumerate(manifest["runs"]):
        run = runs.get(entry["run_id"])
        if run is None:
            continue
        where = f"{entry['name']} (run {entry['run_id'][:8]})"
        _check_weights(report, manifest, entry, where)
        for key in sorted(set(entry["metrics"]) | set(run.data.metrics)):
            report.compare(f"{where}: metric {key}", entry["metrics"].get(key), run.data.metrics.get(key))
        found = evidence[entry["run_id"]]
        _check_outputs(report, entry["outputs"], E.output_hashes(found), where)
        now = E.artifact_hashes(found)
        for name in sorted(set(entry["artifacts"]) | set(now)):
            report.compare(f"{where}: artifact {EVIDENCE_DIR}/{name}", entry["artifacts"].get(name, "absent"),
                           now.get(name, "absent"))
        if entry is baseline:
            derived = base_derived or R.Derived()
        else:  # the items of this run paired with the baseline's, as the release compared them
            derived = R.derive_pair(base_evidence, found, entry["name"], baseline["name"] if baseline else "baseline")
        _check_derived(report, entry["metrics"], derived, where)
        _check_flip_rates(report, derived, _flip_rates(found), where)
        _check_stages(report, manifest, entry, baseline, client, where, (derived, base_derived), work / f"g{i}")
        _check_registration(report, entry, client, digest, where)


def _check_derived(report: Report, recorded: dict[str, float], derived: R.Derived, where: str) -> None:
    """Every metric recomputed from the items against the run's own (hence the manifest's) value."""
    report.mismatches += [f"{where}: {p}" for p in derived.problems]
    report.notes += [f"{where}: {n}" for n in derived.notes]
    for key, value in sorted(derived.metrics.items()):
        if _same(recorded.get(key), value):
            report.checked.append(f"{where}: {key} re-derived from items")
            continue
        said = "none" if recorded.get(key) is None else _short(recorded[key])
        report.mismatches.append(f"{where}: gate {R.gate_of(key)}: {key} recorded {said}, re-derived from the "
                                 f"items {_short(value)}")
    if derived.families:
        report.notes.append(f"{where}: re-derived {'; '.join(derived.families)}")


def _check_weights(report: Report, manifest: dict[str, Any], entry: dict[str, Any], where: str) -> None:
    weights = entry["weights"]
    if not weights["path"]:
        report.notes.append(f"{where}: no weights directory was recorded")
        return
    directory = Path(weights["path"])
    if not directory.is_dir():
        report.mismatches.append(f"{where}: weights directory {directory} is not on this machine")
        return
    now = E.directory_hashes(directory)
    for name in sorted(set(weights["files"]) | set(now)):
        report.compare(f"{where}: weights {name}", weights["files"].get(name, "absent"), now.get(name, "absent"))
    recipe = entry["recipe"]
    if recipe is not None:
        on_disk = directory / "quantgate.json"
        report.compare(f"{where}: recipe (quantgate.json)", recipe,
                       json.loads(on_disk.read_text()) if on_disk.is_file() else None)
        report.compare(f"{where}: recipe's source hash", manifest["source_hash"], recipe["source"]["content_hash"])
    elif entry["role"] == "baseline":
        from quantgate.models import content_hash

        report.compare(f"{where}: source content hash", manifest["source_hash"], content_hash(directory))


def _check_outputs(report: Report, recorded: dict[str, Any], now: dict[str, Any], where: str) -> None:
    for name in sorted(set(recorded) | set(now)):
        a, b = recorded.get(name), now.get(name)
        if a is None or b is None:
            report.mismatches.append(f"{where}: outputs {name} {'appeared' if a is None else 'are gone'}")
            continue
        if a["sha256"] == b["sha256"]:
            report.checked.append(f"{where}: outputs {name}")
            continue
        changed = [i for i, (x, y) in enumerate(zip(a["items"], b["items"], strict=False)) if x != y]
        extra = len(b["items"]) - len(a["items"])
        report.mismatches.append(f"{where}: outputs {name} changed: items {changed[:10]}"
                                 + (f" and {len(changed) - 10} more" if len(changed) > 10 else "")
                                 + (f"; {extra:+d} items" if extra else ""))


def _check_flip_rates(report: Report, derived: R.Derived, recorded: dict[str, float], where: str) -> None:
    """The release judged power at the flip rates of `compare.json` (none: the default rate), so the re-judging
    does too; where the items were re-derived, compare.json's rates must be theirs."""
    if derived.flip_rates and recorded:
        for task in sorted(set(derived.flip_rates) | set(recorded)):
            report.compare(f"{where}: gate task/{task}/max_drop: flip rate in compare.json vs the items",
                           recorded.get(task), derived.flip_rates.get(task))
    derived.flip_rates = recorded


def _flip_rates(evidence: Path | None) -> dict[str, float]:
    """Per-task flip rates from the run's `compare.json` (hash-checked above), as `evaluate_run` reads them."""
    from gates.judging.power import flip_rates

    path = evidence / "compare.json" if evidence else None
    return flip_rates(json.loads(path.read_text())) if path and path.is_file() else {}


def _check_stages(report: Report, manifest: dict[str, Any], entry: dict[str, Any], baseline: dict[str, Any] | None,
                  client: MlflowClient, where: str, derived: tuple[R.Derived, R.Derived | None], work: Path) -> None:
    from gates.judging.judge import judge
    from gates.judging.policy import PolicyError, parse_policy
    from gates.records.evaluation import read_evaluation

    for stage, record in entry["stages"].items():
        recorded = read_evaluation(entry["run_id"], stage, client)
        report.compare(f"{where}: {stage} verdict recorded in MLflow", record["verdict"],
                       recorded.extra.get("verdict") if recorded else "none")
        path = E.download(client, entry["run_id"], f"gates/{stage}/gates.json", work / stage)
        report.compare(f"{where}: {stage} gates.json sha256", record["gates_json_sha256"],
                       E.sha256(path.read_bytes()) if path else None)
        tags = {r.name: asdict(r) for r in recorded.results} if recorded else {}
        _compare_gates(report, f"{where}: {stage} gate (MLflow tags)", record["gates"], tags)
        policy = manifest["policies"].get(record["policy_sha256"])
        if policy is None:
            report.mismatches.append(f"{where}: {stage} policy {record['policy_sha256'][:16]} is not in the manifest")
            continue
        try:
            import yaml

            parsed = parse_policy(yaml.safe_load(policy["text"]), source=policy["source"], text=policy["text"])
        except (PolicyError, yaml.YAMLError) as exc:
            report.mismatches.append(f"{where}: {stage} policy does not parse: {exc}")
            continue
        if entry is baseline:
            continue
        mine, base = derived
        # Judged on what the items give wherever they give it; the recorded numbers only where nothing does.
        variant_metrics = {**_judged_metrics(entry["metrics"]), **mine.metrics}
        base_metrics = {**_judged_metrics(baseline["metrics"]), **(base.metrics if base else {})} if baseline else None
        results = judge(parsed, variant_metrics, base_metrics, stage, mine.flip_rates if stage == "release" else {})
        rejudged = {r.name: asdict(r) for r in results}
        _compare_gates(report, f"{where}: {stage} gate re-judged", record["gates"], rejudged)
        for gate in record["gates"]:
            items = stage == "release" and R.rederived(gate["name"], mine, base)
            (report.rederived if items else report.hash_only).append(f"{where}: {stage} {gate['name']}")


def _judged_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """What the gates read: the run's measurements, not the verdicts recorded beside them."""
    return {k: v for k, v in metrics.items() if not k.startswith(("gate/", "gates/"))}


def _compare_gates(report: Report, what: str, recorded: list[dict[str, Any]], now: dict[str, dict[str, Any]]) -> None:
    by_name = {g["name"]: g for g in recorded}
    for name in sorted(set(by_name) | set(now)):
        a, b = by_name.get(name), now.get(name)
        if a is None or b is None:
            report.mismatches.append(f"{what} {name}: {'not in the manifest' if a is None else 'missing now'}")
            continue
        fields = [f for f in _COMPARED if f in a or f in b] + sorted(
            f for f in set(a) & set(b) - {"name", "stage", "rule", "reason", "ci", *_COMPARED})
        report.compare(f"{what} {name}", {f: a.get(f) for f in fields}, {f: b.get(f) for f in fields})


def _check_registration(report: Report, entry: dict[str, Any], client: MlflowClient, digest: str, where: str) -> None:
    from gates.records.registry import read_approval
    from gates.records.tracking import TAG_MODEL

    version = entry["registered_version"]
    if version is None:
        return
    name = E._registered_name(client, entry["run_id"], version)
    mv = client.get_model_version(name, version)
    report.compare(f"{where}: v{version} model card's manifest sha256", digest, mv.tags.get(E.CARD_SHA_TAG))
    if digest not in (mv.description or ""):
        report.mismatches.append(f"{where}: v{version} model card does not name manifest {digest[:16]}")
    approval = read_approval(get_run(entry["run_id"], client).data.tags[TAG_MODEL], version)
    report.compare(f"{where}: v{version} approval", entry["approval"], asdict(approval) if approval else None)


def render(report: Report, verbose: bool = False) -> str:
    lines = [f"evidence of release {report.release_run_id}: "
             + ("VERIFIED" if report.ok else f"{len(report.mismatches)} MISMATCH(ES)")]
    lines.append(f"authorship: {report.authorship}")
    lines += [f"MISMATCH {m}" for m in report.mismatches]
    lines += [f"note     {n}" for n in report.notes]
    lines.append(f"re-derived from items: {len(report.rederived)} gate(s)"
                 + (f": {', '.join(report.rederived)}" if report.rederived else ""))
    lines.append(f"hash-checked only:     {len(report.hash_only)} gate(s)"
                 + (f": {', '.join(report.hash_only)}" if report.hash_only else ""))
    lines += [f"ok       {c}" for c in report.checked] if verbose else [f"{len(report.checked)} checks agreed"]
    return "\n".join(lines)


__all__ = ["Report", "render", "verify"]
