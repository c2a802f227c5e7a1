"""`quantgate verify` on a release whose speed gates were measured in group-sequential rounds: a consistent record
verifies with its speed gates re-derived from the rounds; a CI or a verdict the rounds do not give, written into a
manifest signed with the verifier's key, fails naming the speed gate.

A small release of its own per case (real MLflow sqlite store in tmp, no weights): the baseline and one variant,
their speed metrics and speed.json made by the release's own loop on crafted timings
(tests/test_verify_sequential_speed.py), judged by the real policy and written through the real API.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_verify_sequential_speed import PLAN, joint

from flows.data import BASELINE
from gates import metric_names as M

POLICY = """\
version: 1
tasks: {max_drop: 0.05}
serving: {min_decode_speedup: 1.0, min_prefill_speedup: 1.0, decode_batches: [1, 4]}
speed: {look_every: 3, max_rounds: 9, long_context: {context: 128}}
"""
B1 = "serve/min_decode_speedup/b1"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    from gates.evidence.signing import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("keys") / "ours")


def _release(tmp_path: Path, variant: str, signing_key: Path, metrics_change=None) -> dict:
    """Baseline and `variant` logged with the metrics and speed.json of the sequential rounds, judged, evidence
    written and signed; `metrics_change(metrics)`: what the writer changes in the variant's metrics before logging."""
    from gates.evidence.manifest import write_evidence
    from gates.records.evaluation import evaluate_run
    from gates.records.tracking import end_release, log_variant, start_release

    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    record, logged = joint(replace(PLAN, decode_batches=(1, 4)))
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps(record))
    metrics = dict(logged[variant])
    if metrics_change is not None:
        metrics_change(metrics)
    release = start_release(f"tiny-{tmp_path.name}"[:60], "0" * 64, {"policy": str(policy)})
    log_variant(release, BASELINE, {"method": "none"}, logged[BASELINE], artifacts=[speed])
    run = log_variant(release, variant, {"method": variant}, metrics, artifacts=[speed])
    evaluation = evaluate_run(run, str(policy))
    write_evidence(release, signing_key=signing_key)
    end_release(release)
    return {"release": release, "run": run, "evaluation": evaluation, "record": record}


def _verdict(evaluation, name: str) -> str:
    return next(r.verdict for r in evaluation.results if r.name == name)


def test_a_consistent_sequential_speed_record_verifies_with_its_gates_rederived(store, tmp_path, keys):
    from gates.evidence.verify import verify

    made = _release(tmp_path, "fast", keys[0])
    assert _verdict(made["evaluation"], B1) == "pass" and made["record"]["looks"]["fast/decode_b1"]["rounds"] == 3
    report = verify(made["release"], verify_key=keys[1])
    assert report.ok, report.mismatches
    where = f"fast (run {made['run'][:8]})"
    for gate in (B1, "serve/min_decode_speedup/b4", "serve/min_prefill_speedup"):
        assert f"{where}: release {gate}" in report.rederived, report.rederived
    assert f"{where}: serve/decode_speedup_b1_ci_low re-derived from items" in report.checked


def test_a_signed_made_up_speed_ci_fails_verify_naming_the_gate(store, tmp_path, keys, capsys):
    """The writer logs a tighter CI than its rounds give: the gate passed when judged, the manifest is hashed and
    signed consistently, and only replaying the rounds shows the CI straddles the minimum."""
    from gates.evidence.verify import verify
    from quantgate.cli import main

    def made_up(metrics: dict) -> None:
        metrics[M.ci(M.decode_speedup(1), "ci_low")] = 1.01

    made = _release(tmp_path, "close-kv8", keys[0], made_up)
    assert made["record"]["looks"]["close-kv8/decode_b1"]["decision"] == "uninformative"
    assert _verdict(made["evaluation"], B1) == "pass"  # judged on the made-up CI
    report = verify(made["release"], verify_key=keys[1])
    assert "signature" in report.checked and not report.ok
    where = f"close-kv8 (run {made['run'][:8]})"
    assert any(m.startswith(f"{where}: gate {B1}: serve/decode_speedup_b1_ci_low recorded 1.01, re-derived from the "
                            "items 0.") for m in report.mismatches), report.mismatches
    rejudged = next(m for m in report.mismatches if f"release gate re-judged {B1}" in m)
    assert '"passed": false' in rejudged.split(", found ", 1)[1]
    assert main(["verify", made["release"], "--key", str(keys[1])]) == 1
    assert f"gate {B1}" in capsys.readouterr().out


def _resign(release: str, private: Path, change) -> None:
    """What a holder of the signing key can do: change the manifest, sign it again, record its hash."""
    from gates.evidence import signing
    from gates.evidence.manifest import CARD_SHA_TAG, MANIFEST_PATH, SIGNATURE_PATH, canonical, sha256
    from gates.records.tracking import get_client, get_run

    root = Path(get_run(release).info.artifact_uri.removeprefix("file://"))
    manifest = json.loads((root / MANIFEST_PATH).read_bytes())
    change(manifest)
    payload = canonical(manifest)
    (root / MANIFEST_PATH).write_bytes(payload)
    signature = signing.sign(payload, signing.load_private_key(private))
    (root / SIGNATURE_PATH).write_text(json.dumps(signature.as_dict()))
    get_client().set_tag(release, CARD_SHA_TAG, sha256(payload))


def test_a_rewritten_and_resigned_speed_verdict_and_ci_fail_verify(store, tmp_path, keys):
    from gates.evidence.verify import verify

    made = _release(tmp_path, "slow", keys[0])
    assert _verdict(made["evaluation"], B1) == "fail"

    def to_pass(manifest: dict) -> None:
        entry = next(r for r in manifest["runs"] if r["name"] == "slow")
        entry["metrics"][M.ci(M.decode_speedup(1), "ci_low")] = 1.02
        gate = next(g for g in entry["stages"]["release"]["gates"] if g["name"] == B1)
        gate["verdict"], gate["passed"] = "pass", True

    _resign(made["release"], keys[0], to_pass)
    report = verify(made["release"], verify_key=keys[1])
    assert "signature" in report.checked and not report.ok
    assert any(f"gate {B1}: serve/decode_speedup_b1_ci_low recorded 1.02, re-derived from the items 0." in m
               for m in report.mismatches), report.mismatches
    assert any(f"release gate re-judged {B1}" in m for m in report.mismatches), report.mismatches
