"""gates/evidence/manifest.py, gates/evidence/verify.py, gates/evidence/signing.py: a release's evidence manifest, its signature, and
`quantgate verify` catching one changed byte of a weight, an output, the policy or a verdict.

Each case records a small release of its own (real MLflow sqlite store in tmp, a real nf4 variant of a
tiny random Llama built by quantize/, real per-item eval logs on our `arith` task's data), writes its
evidence through the real API, changes one thing and verifies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evals.results import EvalResult, SampleResult, TaskResult
from gates import metric_names as M

POLICY = """\
version: 1
tasks: {max_drop: 0.05}
weights: {min_reduction: 0.1}
"""
N = 200


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama (no tokenizer needed) and its nf4 variant, built once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantize.variant import quantize

    root = tmp_path_factory.mktemp("evidence-models")
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(root / "src")
    return {"src": root / "src", "nf4": quantize(str(root / "src"), "nf4", out_dir=root / "nf4")}


@pytest.fixture(scope="module")
def module_store(tmp_path_factory):
    """One MLflow store for the module (creating one costs seconds); each case records its own model."""
    root = tmp_path_factory.mktemp("evidence-store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.setenv("QUANTGATE_HOME", str(root / "home"))
        yield


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    from gates.evidence.signing import generate_keypair

    root = tmp_path_factory.mktemp("keys")
    return {name: generate_keypair(root / name) for name in ("ours", "other")}


def _evals(out: Path, correct: list[bool]) -> Path:
    samples = [SampleResult(i, f"arith-{i:04d}", target=str(i), response=str(i) if ok else "?", score=float(ok),
                            correct=ok) for i, ok in enumerate(correct)]
    task = TaskResult("arith", "accuracy", "exact_match", sum(correct) / len(correct), len(correct), True, True,
                      0.0, False, 0, samples=samples)
    EvalResult("tiny", "engine", ["accuracy"], None, "2026-12-03T00:00:00", {"arith": task}).save(out / "accuracy")
    return out / "accuracy"


BASE_ITEMS = [i % 5 < 3 for i in range(N)]
# The variant loses items 5 and 6 and gains item 8 (item 3 stays wrong: _tamper_output edits its response).
VAR_ITEMS = [(not ok) if i in (5, 6, 8) else ok for i, ok in enumerate(BASE_ITEMS)]


def _paired(base_dir: Path, var_dir: Path, variant: str) -> dict[str, float]:
    """The task metrics the release logs: the real paired delta and bootstrap CI of the items (evals.compare)."""
    from evals.compare import compare

    comparison = compare(EvalResult.load(base_dir), {variant: EvalResult.load(var_dir)})
    row = comparison.row(variant, "arith")
    return M.task_metrics("arith", row.variant_score, delta=row.delta, ci_low=row.ci_low, ci_high=row.ci_high, n=row.n)


def _record(tmp_path: Path, built: dict[str, Path], signing_key: Path | None,
            var_items: list[bool] = VAR_ITEMS, made_up_ci: tuple[float, float] | None = None) -> dict:
    """A release of the copied source and variant: measured, gated, registered, approved, evidence written.
    `made_up_ci`: log that CI instead of the items' (a writer whose aggregates contradict its items)."""
    from gates.evidence.manifest import write_evidence
    from gates.records.evaluation import evaluate_run
    from gates.records.registry import record_approval
    from gates.records.tracking import end_release, log_variant, register_variant, start_release
    from quantgate.models import content_hash
    from serving.model.quant.integrity import read_manifest, weight_bytes

    src, nf4 = shutil.copytree(built["src"], tmp_path / "src"), shutil.copytree(built["nf4"], tmp_path / "nf4")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    model = f"tiny-{tmp_path.name}"[:60].replace("[", "-").replace("]", "")
    release = start_release(model, content_hash(src), {"policy": str(policy)})
    base_dir, var_dir = _evals(tmp_path / "evals-base", BASE_ITEMS), _evals(tmp_path / "evals-nf4", var_items)
    base_metrics = {**M.task_metrics("arith", 0.6, n=N), M.WEIGHTS_BYTES: float(weight_bytes(src)[0])}
    paired = _paired(base_dir, var_dir, "nf4")
    if made_up_ci is not None:  # made up as a whole: the baseline's score, no change, a tight CI around it
        paired.update(M.task_metrics("arith", 0.6, delta=0.0, ci_low=made_up_ci[0], ci_high=made_up_ci[1], n=N))
    var_metrics = {**paired, M.WEIGHTS_BYTES: float(weight_bytes(nf4)[0])}
    base_run = log_variant(release, "baseline", {"method": "none", "variant_path": str(src)}, base_metrics,
                           artifacts=[base_dir])
    run = log_variant(release, "nf4", {"method": "nf4", "variant_path": str(nf4)}, var_metrics,
                      artifacts=[var_dir], manifest=read_manifest(nf4))
    version = register_variant(run, source=nf4)
    evaluation = evaluate_run(run, str(policy))
    record_approval(model, version, by="alice", comment="looks right")
    written = write_evidence(release, signing_key=signing_key)
    end_release(release)
    return {"model": model, "release": release, "run": run, "base_run": base_run, "version": version, "src": src, "nf4": nf4,
            "policy": policy, "evaluation": evaluation, "written": written, "var_metrics": var_metrics}


@pytest.fixture(scope="module")
def pristine(module_store, tmp_path_factory, built, keys) -> dict:
    """A signed release the read-only cases share."""
    return _record(tmp_path_factory.mktemp("pristine"), built, signing_key=keys["ours"][0])


@pytest.fixture
def signed(module_store, tmp_path, built, keys) -> dict:
    """A signed release of the case's own, to change."""
    return _record(tmp_path, built, signing_key=keys["ours"][0])


def _artifact(run_id: str, path: str) -> Path:
    from gates.records.tracking import get_run

    return Path(get_run(run_id).info.artifact_uri.removeprefix("file://")) / path


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _manifest(release: str) -> dict:
    from gates.evidence.manifest import MANIFEST_PATH

    return json.loads(_artifact(release, MANIFEST_PATH).read_bytes())


def test_the_manifest_binds_weights_recipe_policy_data_outputs_verdicts_and_approval(pristine):
    from gates.evidence.manifest import directory_hashes, sha256
    from gates.records.tracking import get_client
    from quantgate.models import file_sha256

    m = _manifest(pristine["release"])
    assert pristine["written"].manifest_sha256 == sha256(_artifact(pristine["release"], "evidence/manifest.json").read_bytes())
    runs = {r["name"]: r for r in m["runs"]}
    assert set(runs) == {"baseline", "nf4"}
    assert m["release_artifacts"] == {"config.json": sha256(_artifact(pristine["release"], "config.json").read_bytes())}
    nf4 = runs["nf4"]
    assert nf4["weights"]["files"] == directory_hashes(pristine["nf4"])
    assert nf4["weights"]["files"]["model.safetensors"] == file_sha256(pristine["nf4"] / "model.safetensors")
    assert nf4["recipe"]["method"] == "nf4" and nf4["recipe"]["source"]["content_hash"] == m["source_hash"]
    assert m["policies"] == {pristine["evaluation"].policy_sha256: {"source": str(pristine["policy"]), "text": POLICY}}
    data = Path(__file__).resolve().parents[1] / "evals" / "tasks" / "data"
    files = [data / "arith.dev.jsonl", data / "arith.jsonl"]  # the few-shot examples and the items
    assert m["eval_data"] == {"arith": {str(f): file_sha256(f) for f in files}}
    items = nf4["outputs"]["accuracy/samples/arith.jsonl"]["items"]
    assert len(items) == N and items[0] == sha256(json.dumps(
        {"doc_id": 0, "item_id": "arith-0000", "target": "0", "response": "0", "score": 1.0, "correct": True,
         "weight": 1.0, "extra": {}}, ensure_ascii=False).encode())
    gates = {g["name"]: g for g in nf4["stages"]["release"]["gates"]}
    ci = [pristine["var_metrics"][M.task_delta_ci_low("arith")], pristine["var_metrics"][M.task_delta_ci_high("arith")]]
    assert gates["task/arith/max_drop"]["verdict"] == "pass" and gates["task/arith/max_drop"]["ci"] == ci
    assert -0.05 < ci[0] < -0.005 < 0.0 <= ci[1]  # the items' own CI (delta -0.005), not a made-up one
    assert gates["weights/min_reduction"]["ci"] is None and nf4["stages"]["release"]["verdict"] == "pass"
    assert (nf4["approval"]["by"], nf4["approval"]["decision"]) == ("alice", "approved")
    card = get_client().get_model_version(f"{pristine['model']}-quantgate", pristine["version"]).description
    assert pristine["written"].manifest_sha256 in card and pristine["written"].key_id in card and "alice" in card


def test_verify_passes_on_an_untouched_release_with_our_key(pristine, keys, capsys):
    from gates.evidence.signing import key_id, load_public_key
    from gates.evidence.verify import verify
    from quantgate.cli import main

    report = verify(pristine["run"], verify_key=keys["ours"][1])  # a variant run leads to its release
    assert report.ok, report.mismatches
    assert report.release_run_id == pristine["release"]
    assert key_id(load_public_key(keys["ours"][1])) in report.authorship
    assert any("re-judged task/arith/max_drop" in c for c in report.checked)
    assert any(c.endswith("task/arith/delta_ci_low re-derived from items") for c in report.checked)
    assert any(g.endswith("release task/arith/max_drop") for g in report.rederived)
    assert any(g.endswith("release weights/min_reduction") for g in report.hash_only)
    assert main(["verify", pristine["release"], "--key", str(keys["ours"][1])]) == 0
    assert "VERIFIED" in capsys.readouterr().out


def test_without_a_key_only_integrity_is_checked_and_said(pristine, capsys):
    from gates.evidence.verify import verify
    from quantgate.cli import main

    report = verify(pristine["release"])
    assert report.ok and "only integrity is checked, not authorship" in report.authorship
    assert main(["verify", pristine["release"]]) == 0
    assert "only integrity is checked, not authorship" in capsys.readouterr().out


def test_the_verify_key_comes_from_the_verifiers_configuration(pristine, keys, monkeypatch):
    from gates.evidence.verify import verify

    monkeypatch.setenv("QUANTGATE_VERIFY_KEY", str(keys["other"][1]))
    report = verify(pristine["release"])
    assert not report.ok
    assert any(m.startswith("signature: signed by key") and "not by the configured verify key" in m
               for m in report.mismatches)


def _tamper_weight(s: dict) -> str:
    _flip_byte(s["nf4"] / "model.safetensors", (s["nf4"] / "model.safetensors").stat().st_size - 7)
    return "nf4 (run "


def _tamper_output(s: dict) -> str:
    path = _artifact(s["run"], "evidence/accuracy/samples/arith.jsonl")
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"response": "?"', b'"response": "!"')
    path.write_bytes(b"".join(lines))
    return "outputs accuracy/samples/arith.jsonl changed: items [3]"


def _tamper_policy(s: dict) -> str:
    s["policy"].write_text(POLICY.replace("0.05", "0.06"))
    return f"policy file {s['policy']}: sha256"


def _tamper_verdict_tag(s: dict) -> str:
    from gates.records.tracking import get_client

    get_client().set_tag(s["run"], M.gate_key("task/arith/max_drop", "verdict"), "fail")
    return "release gate (MLflow tags) task/arith/max_drop"


def _tamper_metric(s: dict) -> str:
    from gates.records.tracking import get_client

    get_client().log_metric(s["run"], M.task_delta_ci_low("arith"), -0.2)
    said = json.dumps(s["var_metrics"][M.task_delta_ci_low("arith")])
    return "nf4 (run " + s["run"][:8] + f"): metric task/arith/delta_ci_low: manifest says {said}, found -0.2"


@pytest.mark.parametrize("tamper", [_tamper_weight, _tamper_output, _tamper_policy, _tamper_verdict_tag, _tamper_metric],
                         ids=["weight", "output", "policy", "verdict-tag", "metric"])
def test_verify_fails_on_one_changed_byte_naming_it(signed, keys, tamper, capsys):
    from gates.evidence.verify import verify
    from quantgate.cli import main

    expected = tamper(signed)
    report = verify(signed["release"], verify_key=keys["ours"][1])
    assert not report.ok and any(expected in m for m in report.mismatches), report.mismatches
    assert main(["verify", signed["release"], "--key", str(keys["ours"][1])]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def _rewrite_manifest(release: str, change) -> None:
    """What someone with write access to the run can do: rewrite the manifest and the tag naming its hash."""
    from gates.evidence.manifest import CARD_SHA_TAG, MANIFEST_PATH, canonical, sha256
    from gates.records.tracking import get_client

    manifest = _manifest(release)
    change(manifest)
    _artifact(release, MANIFEST_PATH).write_bytes(canonical(manifest))
    get_client().set_tag(release, CARD_SHA_TAG, sha256(canonical(manifest)))


def _flip_verdict(manifest: dict) -> None:
    nf4 = next(r for r in manifest["runs"] if r["name"] == "nf4")
    gate = next(g for g in nf4["stages"]["release"]["gates"] if g["name"] == "task/arith/max_drop")
    gate["verdict"], gate["passed"] = "fail", False


def test_a_rewritten_verdict_is_caught_by_rejudging_and_by_the_signature(signed, keys):
    from gates.evidence.verify import verify

    _rewrite_manifest(signed["release"], _flip_verdict)
    unsigned_check = verify(signed["release"])
    assert any("re-judged task/arith/max_drop" in m for m in unsigned_check.mismatches)
    signed_check = verify(signed["release"], verify_key=keys["ours"][1])
    assert any("signature does not match the manifest" in m for m in signed_check.mismatches)


def test_a_signed_manifest_whose_ci_contradicts_its_items_fails_naming_the_gate(module_store, tmp_path, built, keys,
                                                                                capsys):
    """The writer itself logs a made-up CI: the manifest is consistently hashed and signed with our key, the
    recorded gate passed, and only re-deriving the CI from the items shows the variant fails."""
    from gates.evidence.verify import verify
    from quantgate.cli import main

    worse = [ok and i % 5 != 0 for i, ok in enumerate(BASE_ITEMS)]  # 0.6 -> 0.4: a 20-point drop
    forged = _record(tmp_path, built, keys["ours"][0], var_items=worse, made_up_ci=(-0.02, 0.02))
    assert forged["evaluation"].passed  # the made-up CI passed the gate when the release judged it
    report = verify(forged["release"], verify_key=keys["ours"][1])
    assert "signature" in report.checked and not report.ok
    where = f"nf4 (run {forged['run'][:8]})"
    assert any(m.startswith(f"{where}: gate task/arith/max_drop: task/arith/delta_ci_low recorded -0.02, re-derived "
                            "from the items -0.") for m in report.mismatches), report.mismatches
    rejudged = next(m for m in report.mismatches if "release gate re-judged task/arith/max_drop" in m)
    assert '"passed": false' in rejudged.split(", found ", 1)[1]  # judged again on the items: it fails
    assert main(["verify", forged["release"], "--key", str(keys["ours"][1])]) == 1
    assert "gate task/arith/max_drop" in capsys.readouterr().out


def test_items_marked_wrong_and_the_bundle_rewritten_fail_verify(signed, keys, capsys):
    """Issue 48's reproduction: every item of the variant's arith log marked wrong, the bundle re-written with
    `quantgate evidence RUN_ID` (so every hash agrees), verify must still fail on the task gate."""
    from gates.evidence.verify import verify
    from quantgate.cli import main

    path = _artifact(signed["run"], "evidence/accuracy/samples/arith.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({**r, "score": 0.0, "correct": False}, ensure_ascii=False) + "\n" for r in rows))
    assert main(["evidence", signed["release"], "--key", str(keys["ours"][0])]) == 0
    report = verify(signed["release"], verify_key=keys["ours"][1])
    assert "signature" in report.checked and not any("outputs" in m for m in report.mismatches)
    assert any("gate task/arith/max_drop: task/arith/delta_ci_low recorded" in m for m in report.mismatches)
    assert any("gate task/arith/max_drop: task/arith/score recorded 0.595" in m for m in report.mismatches)
    assert any("release gate re-judged task/arith/max_drop" in m for m in report.mismatches)
    capsys.readouterr()
    assert main(["verify", signed["release"], "--key", str(keys["ours"][1])]) == 1


def test_a_forged_missing_or_withdrawn_signature_fails_with_a_key(signed, keys):
    from gates.evidence.manifest import SIGNATURE_PATH, write_evidence
    from gates.evidence.verify import verify

    path = _artifact(signed["release"], SIGNATURE_PATH)
    record = json.loads(path.read_text())
    record["signature"] = record["signature"][:10] + ("A" if record["signature"][10] != "A" else "B") + \
        record["signature"][11:]
    path.write_text(json.dumps(record))
    assert any("does not match" in m for m in verify(signed["release"], verify_key=keys["ours"][1]).mismatches)
    path.unlink()
    report = verify(signed["release"], verify_key=keys["ours"][1])
    assert any("the manifest is unsigned" in m for m in report.mismatches)
    # written again without a key: no older signature stays beside the new manifest
    assert write_evidence(signed["release"], signing_key=None).key_id is None
    report = verify(signed["release"])
    assert report.ok and "only integrity" in report.authorship, report.mismatches
    report = verify(signed["release"], verify_key=keys["ours"][1])
    assert any("the manifest is unsigned" in m for m in report.mismatches)


def test_keygen_writes_a_pair_and_never_replaces_one(tmp_path, capsys):
    from gates.evidence.signing import PRIVATE_NAME, PUBLIC_NAME, load_private_key, load_public_key
    from quantgate.cli import main

    assert main(["keygen", str(tmp_path / "k")]) == 0
    assert (tmp_path / "k" / PRIVATE_NAME).stat().st_mode & 0o077 == 0
    load_private_key(tmp_path / "k" / PRIVATE_NAME), load_public_key(tmp_path / "k" / PUBLIC_NAME)
    assert main(["keygen", str(tmp_path / "k")]) == 2
    assert "never replaces a key" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not an ed25519 private key|not a PEM private key"):
        load_private_key(tmp_path / "k" / PUBLIC_NAME)
