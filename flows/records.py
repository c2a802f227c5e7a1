"""The flow's MLflow side that takes more than one call into `gates.records`: the approval report, champion
lookup, canary records, the summary and the evidence. Single calls (alias moves, approvals, the comparison)
the stages make on `gates.records` directly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.progress import note, stage
from flows.summary import render_markdown as render_summary
from gates import metric_names as M
from gates.evidence.manifest import ERROR_TAG
from gates.evidence.manifest import write_evidence as write_manifest
from gates.evidence.signing import load_private_key
from gates.judging.gate_report import render_markdown
from gates.records import run_notes as notes
from gates.records.evaluation import read_evaluation
from gates.records.registry import CHAMPION, resolve_registered_model, set_initial_champion
from gates.records.registry import aliases as read_aliases
from gates.records.tracking import get_client, log_evidence, log_metrics, register_variant, version_weights
from quantgate import settings
from quantgate.env import home
from quantgate.files import sync_and_drop

if TYPE_CHECKING:
    from flows.data import ReleaseSummary, Source

INITIAL_CHAMPION_REASON = "no champion yet: the release's baseline becomes the initial champion"


def tag_release(run_id: str, tags: dict[str, str]) -> None:
    client = get_client()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def approval_report(summary: ReleaseSummary) -> str:
    """The Markdown the release manager sees on the paused run: every variant's gates, then the ask."""
    parts = [
        f"# Release of `{summary.model}` waits for a decision",
        "",
        f"MLflow release run `{summary.release_run_id}` ({summary.tracking_uri}); "
        f"registered model `{summary.registered_model}`.",
        "",
        "| variant | version | weight MB | gates |",
        "| --- | --- | ---: | --- |",
    ]
    for r in summary.rows[1:]:
        mb = f"{r.weight_bytes / 1e6:.1f}" if r.weight_bytes else "—"
        verdict = "all passed" if r.gates_passed else f"FAILED: {', '.join(r.gates_failed)}"
        parts.append(f"| {r.name} | v{r.version} | {mb} | {verdict} |")
    parts += ["", "Approve to let the smallest approved variant go to the canary stage; reject to stop here.", ""]
    for r in summary.rows[1:]:
        evaluation = read_evaluation(r.run_id, "release")
        if evaluation is not None:
            parts.append(render_markdown(evaluation, r.name))
    return "\n".join(parts)


def _model_version(model: str, version: str):
    """The MLflow client and the registered version `version` of `model` (source or registered name)."""
    client = get_client()
    return client, client.get_model_version(resolve_registered_model(model, client), str(version))


def version_source(model: str, version: str) -> Path:
    """The weights a registered version points at (the flow registers variant directories)."""
    _, mv = _model_version(model, version)
    path = Path(version_weights(mv))  # a tracking server's versions carry their weights' path in a tag
    if not (path / "config.json").is_file():
        raise RuntimeError(f"{model} v{version} points at {mv.source}, which holds no model any more")
    return path


def version_kv_cache_dtype(model: str, version: str) -> str:
    """The KV-cache dtype a registered version was measured with (its run's `kv_cache_dtype` param): a
    version is its weights *and* its cache, so the canary serves it with the same cache."""
    client, mv = _model_version(model, version)
    if not mv.run_id:
        return "auto"
    return client.get_run(mv.run_id).data.params.get("kv_cache_dtype", "auto")


def champion_or_baseline(summary: ReleaseSummary, source: Source) -> tuple[str, Path]:
    """The current champion; with none yet, register this release's baseline and make it champion."""
    current = aliases(source.name).get(CHAMPION)
    if current is not None:
        return current, version_source(source.name, current)
    baseline_row = summary.rows[0]
    weights = snapshot(Path(source.path), source.content_hash)
    version = register_variant(baseline_row.run_id, source=weights, tags={"initial_champion": "true"})
    baseline_row.version = version
    baseline_row.decision = "reference; became the initial champion"
    set_initial_champion(source.name, version, reason=INITIAL_CHAMPION_REASON)
    return version, Path(source.path)  # the snapshot's bytes (hashed alike), whose pages _copy_synced dropped


def snapshot(model_dir: Path, digest: str) -> Path:
    """A registered version must keep pointing at the same weights: a watched model directory is
    rewritten in place by its next release, so the baseline is copied under quantgate's home first (each
    file fsync'd: the registry points at it, and a copy still being written back slowed the next loads —
    the canary's two, 3.7 -> 5.3 s at Qwen2.5-Coder-0.5B)."""

    if not needs_snapshot(model_dir):
        return model_dir  # converted GGUFs and variants under home() are never rewritten in place
    target = home() / "flows" / "snapshots" / digest[:32]
    if not (target / "config.json").is_file():
        tmp = target.with_name(target.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model_dir, tmp, copy_function=_copy_synced)
        tmp.rename(target)
    return target


def needs_snapshot(model_dir: Path) -> bool:
    return not Path(model_dir).resolve().is_relative_to(home().resolve())


def _copy_synced(src: str, dst: str) -> str:
    """Copied, written back, and dropped from the page cache: a later release reads the copy, this one reads the
    source, and a copy kept cached evicted the source's pages as it went (Qwen2.5-Coder-1.5B's 7.1 GB: 11-19 s with
    half the source read back from disk, 4.8-5.0 s with the copy's pages dropped; AMX Xeon VM, 24 GB)."""
    shutil.copy2(src, dst)
    handle = os.open(dst, os.O_RDONLY)
    try:
        sync_and_drop(handle)
    finally:
        os.close(handle)
    return dst


def first_release_copies(model_dir: Path, name: str) -> bool:
    """Whether a release of the model `name` at `model_dir` copies it for the registry first: a source outside
    the home, and no champion yet."""
    return needs_snapshot(model_dir) and aliases(name).get(CHAMPION) is None


def snapshot_first_release(source: Source) -> Path | None:
    """The first release of a model outside quantgate's home registers its baseline as the initial champion
    from a snapshot: made now, before any stage, so its copy is not written back under a later stage's loads
    and the time plan counts it where it runs (gates.time_plan `snapshot`). None: a champion exists, or the
    source needs no copy."""
    if not first_release_copies(Path(source.path), source.name):
        return None
    with stage("snapshot the source for the registry (first release)"):
        return snapshot(Path(source.path), source.content_hash)


def aliases(model: str) -> dict[str, str]:
    """The registered model's aliases; none while nothing is registered under `model`."""
    try:
        resolve_registered_model(model)
    except ValueError:
        return {}
    return read_aliases(model)


def record_canary_metrics(release_run_id: str, challenger_run_id: str, result: dict[str, Any]) -> None:
    """Challenger's canary numbers on its run (what the canary gates judge); champion's on the release."""
    ch = result["challenger"]
    metrics = {M.CANARY_REQUESTS: ch["requests"], M.CANARY_ERROR_RATE: ch["error_rate"]}
    if ch.get("tpot_p99_s") is not None:
        metrics[M.CANARY_TPOT_P99_S] = ch["tpot_p99_s"]
    speed = result.get("speed") or {}
    metrics[M.CANARY_SPEED_WINDOWS] = speed.get("windows", 0)
    for field, key in (("estimate", M.CANARY_TPOT_SPEEDUP), ("ci_low", M.ci(M.CANARY_TPOT_SPEEDUP, "ci_low")),
                       ("ci_high", M.ci(M.CANARY_TPOT_SPEEDUP, "ci_high"))):
        if speed.get(field) is not None:
            metrics[key] = speed[field]
    log_metrics(challenger_run_id, metrics)
    champ = result["champion"]
    release_metrics = {"canary/champion_requests": champ["requests"], "canary/champion_error_rate": champ["error_rate"],
                       "canary/challenger_requests": ch["requests"]}
    if champ.get("tpot_p99_s") is not None:
        release_metrics["canary/champion_tpot_p99_s"] = champ["tpot_p99_s"]
    log_metrics(release_run_id, release_metrics)


def log_canary_artifacts(challenger_run_id: str, result: dict[str, Any]) -> None:
    files = [Path(p) for p in result.get("artifacts", []) if Path(p).exists()]
    if files:
        log_evidence(challenger_run_id, files, subdir="canary")


def log_summary(release_run_id: str, summary: ReleaseSummary) -> None:
    """summary.md/json on the release run, whose description (what the MLflow UI shows first) is the release
    table; each variant run's description is rewritten with the decision and the aliases it ended with."""
    client = get_client()
    text = render_summary(summary)
    client.log_text(release_run_id, text, "summary.md")
    client.log_dict(release_run_id, json.loads(json.dumps(summary.as_dict(), default=str)), "summary.json")
    client.set_tag(release_run_id, "quantgate.outcome", summary.outcome[:5000])
    notes.set_note(client, release_run_id, release_note(summary, text))
    for row in summary.rows:
        held = tuple(sorted(a for a, v in summary.aliases.items() if row.version and str(v) == str(row.version)))
        evaluation = read_evaluation(row.run_id, "release", client)
        if evaluation is None:
            notes.set_note(client, row.run_id, notes.baseline_note(row.name, summary.machine, row.decision, held))
            continue
        metrics = client.get_run(row.run_id).data.metrics
        dtypes = notes.dtype_line(client, row.run_id, evaluation.extra.get("machine", ""))
        notes.set_note(client, row.run_id, notes.variant_note(evaluation, row.name, metrics, row.decision, held, dtypes))


def release_note(summary: ReleaseSummary, table: str) -> str:
    """The release run's description: the outcome and where each alias points (above the UI's fold), then the
    release table (summary.md without its title)."""
    by_version = {str(r.version): r.name for r in summary.rows if r.version}
    held = ", ".join(f"**@{a}** → v{v}" + (f" ({by_version[str(v)]})" if str(v) in by_version else "")
                     for a, v in sorted(summary.aliases.items())) or "no aliases"
    refused = [f"{r.name} ({', '.join(r.gates_failed)})" for r in summary.rows[1:] if r.gates_passed is False]
    lines = [f"**Release of {summary.model}: {summary.outcome}**", "",
             f"- registry: {held}" + (f"; refused: {'; '.join(refused)}" if refused else "")]
    return "\n".join(lines) + "\n\n" + table.split("\n", 2)[2]


def check_signing_key() -> None:
    """A configured signing key that cannot be read fails the release before anything runs."""
    path = settings.key_path(settings.SIGNING_KEY)
    if path is not None:
        load_private_key(path)


def write_evidence(release_run_id: str) -> None:
    """The release's evidence manifest (gates.evidence.manifest). Aliases have moved by now, so a failure to write
    it is recorded on the run and said, not turned into a failed release; `quantgate verify` reports it."""
    try:
        log_alias_history(release_run_id)  # before the manifest, which hashes every release run artifact
    except Exception as exc:  # words for people: never a reason to write no evidence
        note(f"alias history not written for release {release_run_id}: {exc}")
    try:
        written = write_manifest(release_run_id)
    except Exception as exc:
        tag_release(release_run_id, {ERROR_TAG: f"{type(exc).__name__}: {exc}"[:5000]})
        note(f"EVIDENCE NOT WRITTEN for release {release_run_id}: {exc}")
        return
    try:
        describe_versions(release_run_id)
    except Exception as exc:  # the words are for people; the evidence above is what verify checks
        note(f"version descriptions not updated for release {release_run_id}: {exc}")
    signed = f"signed with key {written.key_id}" if written.key_id else "unsigned (no QUANTGATE_SIGNING_KEY)"
    note(f"evidence manifest sha256 {written.manifest_sha256[:16]}, {signed}; quantgate verify {release_run_id}")


_DESCRIPTION_MAX = 4990  # MLflow keeps 5000 characters of a version's description


def version_headline(client, run_id: str, name: str) -> str:
    """What a registered version's description says first: its verdict and the gates behind it."""
    evaluation = read_evaluation(run_id, "release", client)
    if evaluation is None:
        return f"REFERENCE: `{name}` is the baseline every variant of its release was judged against.\n"
    metrics = client.get_run(run_id).data.metrics
    lines = [f"{notes.headline(evaluation)} (release gates)"]  # plain: the versions table shows it raw
    lines += [notes.gate_line(r, metrics) for r in notes.by_attention(evaluation) if not notes.is_clean_pass(r)]
    lines += [line for line in [notes.dtype_line(client, run_id, evaluation.extra.get("machine", ""))] if line]
    return "\n".join(lines) + "\n"


def _registered(client, release_run_id: str) -> list:
    """The registered versions of the release's runs (with their runs)."""
    from gates.records.tracking import release_children

    return [(run, mv) for run in release_children(release_run_id, client)
            for mv in client.search_model_versions(f"run_id = '{run.info.run_id}'")]


def log_alias_history(release_run_id: str) -> None:
    """The alias history as readable Markdown: `registry/alias_history.md` on the release run, and the
    registered model's description (where the raw `alias_history/<seq>` JSON tags are)."""
    from gates.records.registry import alias_history_markdown

    client = get_client()
    names = {mv.name for _, mv in _registered(client, release_run_id)}
    for name in sorted(names):
        history = alias_history_markdown(name)
        client.log_text(release_run_id, history, "registry/alias_history.md")
        client.update_registered_model(name, description=history[:_DESCRIPTION_MAX])


def describe_versions(release_run_id: str) -> None:
    """Each version of the release leads its description (the model card) with its verdict and failing figures."""
    from gates.records.tracking import TAG_VARIANT

    client = get_client()
    for run, mv in _registered(client, release_run_id):
        head = version_headline(client, run.info.run_id, run.data.tags.get(TAG_VARIANT, run.info.run_name))
        card = mv.description or ""
        room = _DESCRIPTION_MAX - len(card) - 2
        client.update_model_version(mv.name, mv.version, description=head[:room] + "\n" + card)
