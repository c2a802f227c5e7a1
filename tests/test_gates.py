"""Gates on a real, temporary MLflow sqlite store: record, evaluate from the store, promote, roll back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gates_fixtures import BAD_ARC, GOOD, NO_TPOT, POLICY_YAML, fluent_tracking, make_release

from gates import metric_names as M
from quantgate.ports import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A fresh sqlite tracking store (and QUANTGATE_HOME for artifacts) for one test module."""
    root = tmp_path_factory.mktemp("gates-store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    patch = pytest.MonkeyPatch()
    patch.setenv("MLFLOW_TRACKING_URI", uri)
    patch.setenv("QUANTGATE_HOME", str(root / "home"))
    patch.setenv("QUANTGATE_USER", "tester")
    yield uri
    patch.undo()


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gates-policy") / "policy.yaml"
    path.write_text(POLICY_YAML)
    return path


def _client():
    from gates.records.tracking import get_client

    return get_client()


def _artifact(run_id: str, path: str, tmp_path: Path) -> Path:
    return Path(_client().download_artifacts(run_id, path, str(tmp_path)))


def test_passing_variant_is_promotable_and_readable_back(store, policy_file, tmp_path):
    import mlflow

    from gates.records.evaluation import evaluate_run
    from gates.records.registry import PromotionRefused, promote, read_approval, record_approval

    runs = make_release("m-pass", {"int8": GOOD})
    run_id, version = runs["int8"]
    evaluation = evaluate_run(run_id, str(policy_file))
    assert evaluation.passed, [r.reason for r in evaluation.failed]
    assert {r.name for r in evaluation.results} == {
        "task/arc/max_drop", "task/hellaswag/max_drop", "safety/refusal_rate/max_fall",
        "safety/over_refusal_rate/max_rise", "weights/min_reduction", "serve/max_tpot_p99_s",
    }
    by_name = {r.name: r for r in evaluation.results}
    assert by_name["task/arc/max_drop"].observed == pytest.approx(-0.03)  # the CI bound, not the point delta
    assert by_name["task/hellaswag/max_drop"].threshold == pytest.approx(-0.10)  # per-task override
    assert by_name["weights/min_reduction"].observed == pytest.approx(1 - 220 / 538)

    with pytest.raises(PromotionRefused, match="no approval recorded"):
        promote("m-pass", version)
    record_approval("m-pass", version, by="alice", comment="evidence reviewed in the MLflow UI")
    move = promote("m-pass", version, reason="first release")
    assert (move.alias, move.version, move.previous, move.kind) == ("champion", version, None, "promote")

    # Everything the decision rests on is readable back through MlflowClient ...
    client = _client()
    name = "m-pass-quantgate"
    assert str(client.get_model_version_by_alias(name, "champion").version) == version
    mv = client.get_model_version(name, version)
    assert mv.tags["verdict"] == "pass" and mv.tags["approval.by"] == "alice" and mv.tags["method"] == "int8"
    run = client.get_run(run_id)
    assert run.data.tags["gates/release/verdict"] == "pass"
    # A clean pass gets no tags of its own (every field is in gates.json and the table); the note says it.
    assert not [k for k in run.data.tags if k.startswith("gate/")]
    assert run.data.tags["mlflow.note.content"].startswith("**int8: PASSED: every gate passed**")
    assert run.data.metrics["gate/task/arc/max_drop/pass"] == 1.0
    assert run.data.metrics["gate/task/arc/max_drop/observed"] == pytest.approx(-0.03)
    assert run.data.tags["mlflow.parentRunId"] == runs["release"][0]
    assert run.data.params["lib/mlflow"] == mlflow.__version__
    assert read_approval(name, version).comment == "evidence reviewed in the MLflow UI"
    # ... and through mlflow.search_runs (what the UI shows).
    with fluent_tracking(store):
        frame = mlflow.search_runs(experiment_names=["quantgate/m-pass"])
    assert len(frame) == 3  # release, baseline, int8
    row = frame[frame["run_id"] == run_id].iloc[0]
    assert row["tags.gates/release/verdict"] == "pass"
    assert row["metrics.task/arc/delta_ci_low"] == pytest.approx(-0.03)
    assert row["metrics.gate/weights/min_reduction/observed"] == pytest.approx(1 - 220 / 538)
    report = _artifact(run_id, "gates/release/gates.md", tmp_path).read_text()
    assert "PASS" in report and "`task/hellaswag/max_drop`" in report and "-0.08" in report
    recorded = json.loads(_artifact(run_id, "gates/release/gates.json", tmp_path).read_text())
    assert recorded["passed"] is True and len(recorded["results"]) == 6
    assert _artifact(run_id, "gates/release/task_deltas.png", tmp_path).read_bytes()[:8] == PNG_MAGIC
    table = json.loads(_artifact(run_id, "gates/release/gates_table.json", tmp_path).read_text())
    assert table["columns"][:3] == ["gate", "verdict", "blocks"] and len(table["data"]) == 6
    manifest = json.loads(_artifact(run_id, "variant/quantgate.json", tmp_path).read_text())
    assert manifest["method"] == "int8"


def test_failing_task_gate_is_refused_with_the_reason(store, policy_file):
    from gates.records.evaluation import evaluate_run
    from gates.records.registry import PromotionRefused, aliases, promote, record_approval

    run_id, version = make_release("m-fail", {"int4": BAD_ARC})["int4"]
    evaluation = evaluate_run(run_id, str(policy_file))
    assert not evaluation.passed
    assert [r.name for r in evaluation.failed] == ["task/arc/max_drop"]
    failed = evaluation.failed[0]
    assert failed.observed == pytest.approx(-0.09) and failed.threshold == pytest.approx(-0.05)
    record_approval("m-fail", version, by="bob", comment="approving anyway")
    with pytest.raises(PromotionRefused) as refused:
        promote("m-fail", version)
    assert len(refused.value.reasons) == 1
    assert "task/arc/max_drop" in refused.value.reasons[0] and "-0.09 < -0.05" in refused.value.reasons[0]
    assert "champion" not in aliases("m-fail")
    assert _client().get_model_version("m-fail-quantgate", version).tags["verdict"] == "fail"


def test_missing_metric_fails_its_gate(store, policy_file):
    from gates.judging.verdicts import NOT_MEASURED
    from gates.records.evaluation import evaluate_run, read_evaluation

    run_id, _ = make_release("m-missing", {"nf4": NO_TPOT})["nf4"]
    evaluation = evaluate_run(run_id, str(policy_file))
    assert [r.name for r in evaluation.failed] == ["serve/max_tpot_p99_s"]
    assert evaluation.failed[0].observed is None
    assert evaluation.failed[0].reason.startswith(NOT_MEASURED)
    run = _client().get_run(run_id)
    assert run.data.metrics["gate/serve/max_tpot_p99_s/pass"] == 0.0
    assert "gate/serve/max_tpot_p99_s/observed" not in run.data.metrics
    assert run.data.tags["gate/serve/max_tpot_p99_s/observed"] == NOT_MEASURED
    assert read_evaluation(run_id).failed[0].name == "serve/max_tpot_p99_s"

    # Without a baseline run, every gate that compares against it is "not measured" too.
    orphan, _ = make_release("m-nobase", {"int8": GOOD}, baseline=None)["int8"]
    failed = {r.name for r in evaluate_run(orphan, str(policy_file)).failed}
    assert failed == {"safety/refusal_rate/max_fall", "safety/over_refusal_rate/max_rise", "weights/min_reduction"}


def test_verdicts_come_from_the_store_and_approval_must_follow_them(store, policy_file):
    from gates.records.evaluation import evaluate_run
    from gates.records.registry import PromotionRefused, check_promotable, promote, record_approval
    from gates.records.tracking import log_metrics

    run_id, version = make_release("m-store", {"int8": GOOD})["int8"]
    assert check_promotable("m-store", version)[0].startswith("no gate evaluation recorded")
    assert evaluate_run(run_id, str(policy_file)).passed
    record_approval("m-store", version, by="carol", decision="rejected", comment="wait for canary")
    with pytest.raises(PromotionRefused, match="'rejected' by carol"):
        promote("m-store", version)
    record_approval("m-store", version, by="carol", comment="ok now")
    # A later measurement lands in MLflow; re-evaluation reads it from there, not from memory.
    log_metrics(run_id, {M.task_delta_ci_low("arc"): -0.20})
    evaluation = evaluate_run(run_id, str(policy_file))
    assert [r.name for r in evaluation.failed] == ["task/arc/max_drop"]
    reasons = check_promotable("m-store", version)
    assert any("task/arc/max_drop failed" in r for r in reasons)
    assert any("predates the latest gate evaluation" in r for r in reasons)
    log_metrics(run_id, {M.task_delta_ci_low("arc"): -0.01})
    assert evaluate_run(run_id, str(policy_file)).passed
    assert ["predates" in r for r in check_promotable("m-store", version)] == [True]
    record_approval("m-store", version, by="carol", comment="re-reviewed")
    assert promote("m-store", version).version == version

    # Canary SLOs: a failed canary evaluation blocks the next promotion of that version.
    log_metrics(run_id, {M.CANARY_ERROR_RATE: 0.05, M.CANARY_TPOT_P99_S: 0.4})
    canary = evaluate_run(run_id, str(policy_file), stage="canary")
    assert [r.name for r in canary.failed] == ["canary/max_error_rate"]
    assert _client().get_model_version("m-store-quantgate", version).tags["canary_verdict"] == "fail"
    assert any(r.startswith("canary gate canary/max_error_rate failed") for r in check_promotable("m-store", version))


def test_rollback_restores_the_previous_champion(store, policy_file):
    from gates.records.evaluation import evaluate_run
    from gates.records.registry import (
        alias_history,
        aliases,
        clear_challenger,
        promote,
        record_approval,
        rollback,
        set_challenger,
        set_initial_champion,
    )
    from gates.records.tracking import register_variant

    runs = make_release("m-roll", {"int8": GOOD, "nf4": GOOD})
    for name in ("int8", "nf4"):
        assert evaluate_run(runs[name][0], str(policy_file)).passed
        record_approval("m-roll", runs[name][1], by="dana")
    v1, v2 = runs["int8"][1], runs["nf4"][1]
    with pytest.raises(ValueError, match="no champion"):
        rollback("m-roll")
    with pytest.raises(ValueError, match="not a baseline version"):
        set_initial_champion("m-roll", v1)
    v0 = register_variant(runs["baseline"][0])
    set_initial_champion("m-roll", v0, reason="first release: the fp32 baseline")
    with pytest.raises(ValueError, match="already has a champion"):
        set_initial_champion("m-roll", v0)
    promote("m-roll", v1)
    set_challenger("m-roll", v2, reason="smaller weights")
    assert aliases("m-roll") == {"champion": v1, "challenger": v2}
    promote("m-roll", v2)
    assert aliases("m-roll") == {"champion": v2}  # the challenger alias moved with it
    move = rollback("m-roll", reason="p99 TPOT regression in production")
    assert (move.version, move.previous, move.kind) == (v1, v2, "rollback")
    assert aliases("m-roll") == {"champion": v1}
    assert str(_client().get_model_version_by_alias("m-roll-quantgate", "champion").version) == v1
    assert _client().get_model_version("m-roll-quantgate", v2).tags["rolled_back_reason"].startswith("p99 TPOT")
    set_challenger("m-roll", v2, reason="retry after the fix")
    assert clear_challenger("m-roll", reason="canary failed", version=v1) is None  # points at v2, not v1
    assert clear_challenger("m-roll", reason="canary failed", version=v2).previous == v2
    assert "canary failed" in _client().get_model_version("m-roll-quantgate", v2).tags["challenger_cleared"]
    history = alias_history("m-roll")
    assert [(m.alias, m.kind, m.version) for m in history] == [
        ("champion", "initial", v0),
        ("champion", "promote", v1),
        ("challenger", "challenger", v2),
        ("champion", "promote", v2),
        ("challenger", "clear", None),
        ("champion", "rollback", v1),
        ("challenger", "challenger", v2),
        ("challenger", "clear", None),
    ]
    assert [m.at for m in history] == sorted(m.at for m in history)
    assert all(m.reason and m.by == "tester" for m in history)
    assert rollback("m-roll").version == v0
    with pytest.raises(ValueError, match="no previous champion"):
        rollback("m-roll")


def test_cli_show_approve_promote_rollback(store, policy_file, capsys, monkeypatch):
    from quantgate.cli import main

    monkeypatch.setenv("COLUMNS", "220")
    runs = make_release("m-cli", {"int8": GOOD, "int4": BAD_ARC})
    good_run, v_good = runs["int8"]
    bad_run, v_bad = runs["int4"]
    assert main(["gates", "evaluate", "--run-id", good_run, "--policy", str(policy_file)]) == 0
    assert main(["gates", "evaluate", "--run-id", bad_run, "--policy", str(policy_file)]) == 1
    capsys.readouterr()

    assert main(["gates", "show", "--model", "m-cli", "--version", v_bad]) == 0
    out = capsys.readouterr().out
    assert "task/arc/max_drop" in out and "FAIL" in out and "weights/min_reduction" in out
    assert main(["gates", "show", "--model", "m-cli"]) == 0
    out = capsys.readouterr().out
    assert "int8" in out and "int4" in out and "fail" in out

    assert main(["promote", "--model", "m-cli", "--version", v_good]) == 2
    assert "no approval recorded" in capsys.readouterr().err
    assert main(["gates", "approve", "--model", "m-cli", "--version", v_good, "--by", "erin", "--comment", "ok"]) == 0
    assert main(["promote", "--model", "m-cli", "--version", v_good]) == 0
    assert main(["rollback", "--model", "m-cli"]) == 2
    assert "no previous champion" in capsys.readouterr().err
    assert main(["gates", "history", "--model", "m-cli-quantgate"]) == 0
    assert "promote" in capsys.readouterr().out
    assert main(["gates", "show", "--model", "nope"]) == 2
    assert "no registered model 'nope'" in capsys.readouterr().err

    assert main(["mlflow-ui", "--print-only", "--port", "5123"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("mlflow ui --backend-store-uri " + store) and "--port 5123" in printed


def test_release_comparison_is_logged_on_the_release_run(store, policy_file, tmp_path):
    from gates.records.comparison import log_release_comparison
    from gates.records.evaluation import evaluate_run

    runs = make_release("m-compare", {"int8": GOOD, "int4": BAD_ARC}, register=False)
    for name in ("int8", "int4"):
        evaluate_run(runs[name][0], str(policy_file))
    release = runs["release"][0]
    text = log_release_comparison(release)
    first = text.split("\n\n")[2].splitlines()  # the title, the legend, then the first table
    assert [r.split(" | ")[0] for r in first[2:]] == ["| baseline", "| int8", "| int4"]
    assert first[3].startswith("| int8 | PASSED: every gate passed | 0.409× (220 MB) | 6/6 |")
    assert first[4].startswith("| int4 | NEEDS A PERSON: blocked only by 1 uninformative gate(s) |")
    assert first[4].endswith("| `task/arc/max_drop` **uninformative, blocks** -0.09 [-0.09, 0.03] vs -0.05 |")
    assert "-0.03 [-0.09, 0.03]" in text  # the task table keeps every delta and CI
    assert _artifact(release, "comparison/comparison.md", tmp_path).read_text() == text
    assert _artifact(release, "comparison/comparison.png", tmp_path).read_bytes()[:8] == PNG_MAGIC


def test_recording_rejects_bad_input(store):
    from gates.records.evaluation import evaluate_run
    from gates.records.tracking import log_variant, register_variant, start_release

    release = start_release("m-bad", "sha256:0", {})
    with pytest.raises(ValueError, match="'task/arc/score' is nan"):
        log_variant(release, "int8", {}, {"task/arc/score": float("nan")})
    with pytest.raises(ValueError, match="'weights/bytes' is str"):
        log_variant(release, "int8", {}, {"weights/bytes": "220MB"})
    with pytest.raises(ValueError, match="does not exist"):
        log_variant(release, "int8", {}, {}, artifacts=[Path("/nonexistent/samples.jsonl")])
    base = log_variant(release, "baseline", {}, {"weights/bytes": 1.0})
    with pytest.raises(ValueError, match="already has a run for variant 'baseline'"):
        log_variant(release, "baseline", {}, {})
    with pytest.raises(ValueError, match="is the baseline"):
        evaluate_run(base)
    with pytest.raises(ValueError, match="not a quantgate variant run"):
        register_variant(release)
    with pytest.raises(ValueError, match="no MLflow run"):
        log_variant("0" * 32, "int8", {}, {})
    with pytest.raises(ValueError, match="variant name"):
        log_variant(release, "int8 fast!", {}, {})


def _group_alive(pgid: int) -> bool:
    import os

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_mlflow_server_serves_runs_over_rest(store, policy_file, tmp_path, monkeypatch):
    """`mlflow server` on loopback over our store: read a run through REST, then record through it."""
    import os
    import signal
    import subprocess
    import time

    import httpx

    from gates.records.evaluation import evaluate_run
    from gates.records.tracking import ui_command, ui_env

    run_id, version = make_release("m-rest", {"int8": GOOD})["int8"]
    evaluate_run(run_id, str(policy_file))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(ui_command(port=port, verb="server"), env=ui_env(), cwd=tmp_path, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mlflow server not healthy after 120 s"
            time.sleep(0.5)

        reply = httpx.get(f"{base}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=30)
        assert reply.status_code == 200, reply.text
        data = reply.json()["run"]["data"]
        metrics = {m["key"]: m["value"] for m in data["metrics"]}
        tags = {t["key"]: t["value"] for t in data["tags"]}
        assert metrics["task/arc/delta_ci_low"] == pytest.approx(-0.03)
        assert metrics["gate/task/arc/max_drop/pass"] == 1.0
        assert tags["gates/release/verdict"] == "pass" and tags["quantgate.variant"] == "int8"
        reply = httpx.get(f"{base}/api/2.0/mlflow/model-versions/get",
                          params={"name": "m-rest-quantgate", "version": version}, timeout=30)
        assert reply.json()["model_version"]["run_id"] == run_id

        # The same recording API works unchanged against a tracking server (kept small: REST is slow here).
        monkeypatch.setenv("MLFLOW_TRACKING_URI", base)
        remote_run, remote_version = make_release("m-remote", {"int4": BAD_ARC}, baseline=None)["int4"]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
        mv = _client().get_model_version("m-remote-quantgate", remote_version)  # read from the sqlite file
        assert mv.run_id == remote_run and mv.tags["verdict"] == "pending"
        assert _client().get_run(remote_run).data.metrics["task/arc/delta_ci_low"] == pytest.approx(-0.09)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            pytest.fail("mlflow server ignored SIGTERM for 30 s")
        finally:
            log.close()
    deadline = time.monotonic() + 15
    while _group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(process.pid), "mlflow server left worker processes behind"
