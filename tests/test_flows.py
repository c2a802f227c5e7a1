"""flows/: approval mechanics, model watching, the event-triggered deployment, and the release flow end to
end on the tiny model (real Prefect API from the test harness, real MLflow sqlite store, real engine).

One Prefect test harness for the whole module (starting it takes 15-30 s on 2 cores).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest
from test_watch import model_dir

from flows.runtime import prepare

prepare()


@pytest.fixture(scope="module", autouse=True)
def own_registry(tmp_path_factory):
    """This module's MLflow store: its first release must find no champion, whatever other modules the same
    `pytest -n` worker ran before (test_kv_quant's release registered tiny-llama's champion in the session's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path_factory.mktemp('flows-mlflow') / 'mlflow.db'}")
        yield


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# ---- approval: the decision form --------------------------------------------------------------------


def test_decide_covers_all_candidates_or_the_named_ones():
    from flows.approval import ApprovalInput, decide

    everyone = decide(["int8", "nf4"], ApprovalInput(approve=True, comment="ok", by="ana"))
    assert everyone.approved == {"int8": True, "nf4": True}
    assert (everyone.by, everyone.comment) == ("ana", "ok")
    only_nf4 = decide(["int8", "nf4"], ApprovalInput(approve=True, by="ana", variants=["nf4"]))
    assert only_nf4.approved == {"int8": False, "nf4": True}
    rejected = decide(["int8", "nf4"], ApprovalInput(approve=False, by="bo", comment="too slow"))
    assert rejected.approved == {"int8": False, "nf4": False}
    with pytest.raises(ValueError, match="fp4: not a candidate"):
        decide(["int8"], ApprovalInput(approve=True, variants=["fp4"]))


def test_approve_refuses_what_is_not_a_paused_run(prefect_api):
    from flows.approval import submit_decision

    with pytest.raises(ValueError, match="not a Prefect flow run id"):
        submit_decision("release-42", approve=True, comment="ok")
    with pytest.raises(ValueError, match="needs a --comment"):
        submit_decision(str(uuid.uuid4()), approve=True, comment="  ")
    with pytest.raises(ValueError, match="no flow run"):
        submit_decision(str(uuid.uuid4()), approve=True, comment="ok")


# ---- run on model change ----------------------------------------------------------------------------


def test_model_change_event_triggers_the_deployment_with_its_parameters(prefect_api, tmp_path):
    """watch sees the model change -> notify emits quantgate.model.changed -> the trigger creates a run."""
    from prefect import get_client

    from flows.deploy import build_deployment, event_payload, notify
    from flows.watch import ModelWatcher

    build_deployment("test-on-change", ray_address="10.0.0.5:6379").apply()  # `quantgate deploy --ray-address`
    model = model_dir(tmp_path)
    watcher = ModelWatcher([model], debounce_s=0.0)
    (model / "model.safetensors").write_bytes(b"\x07" * 64)
    assert watcher.poll() == []
    (change,) = watcher.poll()
    payload = event_payload(["nf4"], None, "manual", 3, suites=["facts_mc"], content_hash=change.new_digest)
    result = notify(str(change.path), payload, wait_s=60, deployment="test-on-change")
    assert result.deployment == "quantgate-release/test-on-change"
    assert result.flow_run_id is not None, "the event trigger created no flow run within 60 s"
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(uuid.UUID(result.flow_run_id))
    assert run.parameters == {"model": str(model.resolve()), "methods": ["nf4"], "policy": None,
                              "approve": "manual", "limit": 3, "suites": ["facts_mc"], "ray_address": "10.0.0.5:6379"}


# ---- the release flow on the tiny model -------------------------------------------------------------

FAST_SUITES = ["facts_mc", "perplexity"]  # loglikelihood tasks: seconds on the tiny model
POLICY = """
version: 1
tasks: {max_drop: 1.0}
safety: {refusal_rate_max_fall: null, over_refusal_rate_max_rise: null}
weights: {min_reduction: null}
serving: {min_decode_speedup: null, max_tpot_p99_s: %s}
canary: {max_error_rate: 0.0, max_tpot_p99_s: %s}
"""


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("policies")
    (d / "pass.yaml").write_text(POLICY % ("60.0", "60.0"))
    (d / "fail.yaml").write_text(POLICY % ("1.0e-6", "60.0"))  # no engine decodes a token in a microsecond
    (d / "canary_fail.yaml").write_text(POLICY % ("60.0", "1.0e-6"))
    return {name: str(d / f"{name}.yaml") for name in ("pass", "fail", "canary_fail")}


def _release(model: Path, policy: str, **kw) -> dict:
    from flows.release import release_flow

    options = dict(methods=["nf4"], limit=4, suites=FAST_SUITES, canary_requests=8, approve="auto")
    options.update(kw)
    return release_flow(model=str(model), policy=policy, **options)


def _task_runs(flow_run_id: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))


@pytest.fixture(scope="module")
def first_release(prefect_api, tiny_model_dir, policies) -> dict:
    return _release(tiny_model_dir, policies["pass"])


def test_release_end_to_end_promotes_the_variant_after_the_canary(first_release, tmp_path):
    from gates.records import registry
    from gates.records.evaluation import read_evaluation
    from gates.records.tracking import get_client, get_run, release_children

    s = first_release
    assert [r["name"] for r in s["rows"]] == ["baseline", "nf4"]
    nf4 = s["rows"][1]
    assert nf4["gates_passed"] is True and nf4["gates_failed"] == []
    assert s["chosen"] == "nf4"
    # no champion existed: the baseline was registered and became the initial champion, then nf4 won
    assert s["canary"]["champion_version"] == s["rows"][0]["version"]
    assert s["canary"]["passed"] is True
    assert registry.aliases(s["model"]) == {"champion": nf4["version"]}
    history = [(m.alias, m.version, m.kind) for m in registry.alias_history(s["model"])]
    assert history[0] == ("champion", s["rows"][0]["version"], "initial")
    assert ("challenger", nf4["version"], "challenger") in history
    assert history[-2:] == [("champion", nf4["version"], "promote"), ("challenger", None, "clear")]
    # everything readable back from MLflow: runs, metrics, verdicts, approval, canary
    client = get_client()
    release = get_run(s["release_run_id"], client)
    assert release.info.status == "FINISHED"
    assert {r.data.tags["quantgate.variant"] for r in release_children(s["release_run_id"], client)} == {"baseline", "nf4"}
    run = get_run(nf4["run_id"], client)
    assert run.data.metrics["task/facts_mc/n"] == 4
    assert "serve/tpot_p99_s" in run.data.metrics and "weights/bytes" in run.data.metrics
    # the paired speed evidence: a ratio with its CI per operating point, and the machine it was taken on
    for key in ("serve/decode_speedup_b1", "serve/decode_speedup_b4", "serve/decode_speedup_b16", "serve/prefill_speedup"):
        assert run.data.metrics[f"{key}_ci_low"] <= run.data.metrics[key] <= run.data.metrics[f"{key}_ci_high"]
    assert run.data.metrics["serve/speed_rounds"] == 5 and "weights/loaded_bytes" in run.data.metrics
    assert "kernel path" in run.data.tags["quantgate.machine"] and s["machine"] == run.data.tags["quantgate.machine"]
    assert run.data.metrics["canary/speed_windows"] >= 1
    assert run.data.metrics["canary/error_rate"] == 0.0 and run.data.metrics["canary/requests"] >= 1
    assert read_evaluation(nf4["run_id"], "release").passed
    assert read_evaluation(nf4["run_id"], "canary").passed
    canary = json.loads(Path(client.download_artifacts(nf4["run_id"], "canary/canary.json", tmp_path)).read_text())
    assert list(canary["seconds"]) == ["up", "replay", "judge", "down"] and min(canary["seconds"].values()) >= 0
    approval = registry.read_approval(s["model"], nf4["version"])
    assert (approval.decision, approval.by) == ("approved", "quantgate-auto")
    # the quantize task ran as a Prefect task, and its result was persisted for reruns
    states = {t.name.split("-")[0]: t.state.name for t in _task_runs(s["flow_run_id"])}
    assert states["quantize"] in ("Completed", "Cached")


def test_the_release_writes_evidence_that_verify_accepts(first_release):
    from gates.evidence.manifest import CARD_SHA_TAG
    from gates.evidence.verify import verify
    from gates.records.tracking import get_client, get_run

    s = first_release
    report = verify(s["release_run_id"])
    assert report.ok, report.mismatches
    assert "only integrity is checked, not authorship" in report.authorship  # no QUANTGATE_VERIFY_KEY here
    digest = get_run(s["release_run_id"]).data.tags[CARD_SHA_TAG]
    nf4 = s["rows"][1]
    assert digest in get_client().get_model_version(s["registered_model"], nf4["version"]).description


def test_a_failing_gate_promotes_nothing(first_release, tiny_model_dir, policies):
    from gates.records import registry
    from gates.records.evaluation import read_evaluation

    before = registry.aliases(first_release["model"])
    s = _release(tiny_model_dir, policies["fail"])
    nf4 = s["rows"][1]
    assert nf4["gates_passed"] is False
    assert "serve/max_tpot_p99_s" in nf4["gates_failed"]
    assert s["chosen"] is None and s["canary"] == {}
    assert "nothing promoted" in s["outcome"]
    assert registry.aliases(s["model"]) == before
    assert registry.read_approval(s["model"], nf4["version"]) is None
    failed = read_evaluation(nf4["run_id"], "release").failed
    assert [r.name for r in failed] == ["serve/max_tpot_p99_s"]
    # measurements were cached from the first release: nothing measured twice
    states = {t.name.split("-")[0]: t.state.name for t in _task_runs(s["flow_run_id"])}
    assert states["measure"] == "Cached" and states["quantize"] == "Cached"
    named = {t.name.rsplit("-", 1)[0]: t.state.name for t in _task_runs(s["flow_run_id"])}
    assert named["measure-speed"] == "Cached" and named["measure"] == "Cached"  # the paired rounds too


def test_a_failing_canary_rolls_back(first_release, tiny_model_dir, policies):
    from gates.records import registry
    from gates.records.tracking import get_client, get_run

    before = registry.aliases(first_release["model"])
    s = _release(tiny_model_dir, policies["canary_fail"])
    nf4 = s["rows"][1]
    assert nf4["gates_passed"] is True and s["chosen"] == "nf4"
    assert s["canary"]["passed"] is False and s["canary"]["failed"] == ["canary/max_tpot_p99_s"]
    assert "rolled back" in s["outcome"] and nf4["decision"].endswith("canary failed -> rolled back")
    assert registry.aliases(s["model"]) == before  # champion unchanged, challenger withdrawn
    moves = [(m.alias, m.version, m.kind) for m in registry.alias_history(s["model"])][-2:]
    assert moves == [("challenger", nf4["version"], "challenger"), ("challenger", None, "clear")]
    run = get_run(nf4["run_id"], get_client())
    assert run.data.tags["gates/canary/verdict"] == "fail"
    assert run.data.metrics["canary/tpot_p99_s"] > 1e-6


def _paused_release(model: Path, policy: str, answer: dict) -> tuple[dict, str]:
    """Run a manual release in a thread, wait until it pauses, answer like `quantgate approve` does."""
    import threading

    from flows.approval import paused_runs, submit_decision

    box: dict = {}

    def target() -> None:
        try:
            box["summary"] = _release(model, policy, approve="manual", approval_timeout_s=300)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test below
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 240
    run = None
    while run is None and time.monotonic() < deadline and thread.is_alive():
        runs = [r for r in paused_runs() if r.parameters.get("model") == str(model)]
        run = runs[0] if runs else None
        time.sleep(0.5)
    assert run is not None, f"the release never paused for approval: {box.get('error')!r}"
    state = submit_decision(str(run.id), **answer, wait_s=0)
    thread.join(timeout=300)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    return box["summary"], state


def test_manual_approval_pauses_and_resumes_with_approve(first_release, tiny_model_dir, policies):
    from gates.records import registry

    s, _ = _paused_release(tiny_model_dir, policies["pass"],
                           {"approve": True, "comment": "numbers look fine", "by": "ana"})
    nf4 = s["rows"][1]
    assert nf4["decision"].startswith("approved by ana")
    approval = registry.read_approval(s["model"], nf4["version"])
    assert (approval.decision, approval.by, approval.comment) == ("approved", "ana", "numbers look fine")
    assert registry.aliases(s["model"])["champion"] == nf4["version"]
    # the canary ran against the previous champion (the first release's nf4), not the baseline
    assert s["canary"]["champion_version"] == first_release["rows"][1]["version"]


def test_manual_approval_pauses_and_resumes_with_reject(first_release, tiny_model_dir, policies):
    from gates.records import registry

    before = registry.aliases(first_release["model"])
    s, _ = _paused_release(tiny_model_dir, policies["pass"],
                           {"approve": False, "comment": "not this week", "by": "bo"})
    nf4 = s["rows"][1]
    assert nf4["decision"].startswith("rejected by bo")
    assert s["chosen"] is None and "nothing promoted" in s["outcome"]
    approval = registry.read_approval(s["model"], nf4["version"])
    assert (approval.decision, approval.by, approval.comment) == ("rejected", "bo", "not this week")
    assert registry.aliases(s["model"]) == before


def test_a_task_that_fails_once_is_retried(prefect_api, tiny_model_dir, tmp_path):
    """The source's weights are half-written when quantization starts (a copy still in progress): the
    first attempt fails, the file is complete by the time Prefect decides to retry, the retry succeeds."""
    from prefect import get_client

    from flows.release import Source
    from flows.release_tasks import TASK_RETRIES, quantize_method, transient
    from quantgate.models import content_hash

    source_dir = tmp_path / "copy-in-progress"
    shutil.copytree(tiny_model_dir, source_dir)
    weights = source_dir / "model.safetensors"
    complete = weights.read_bytes()
    weights.write_bytes(complete[: len(complete) // 3])
    failures: list[BaseException] = []

    def copy_finishes_then_decide(task, task_run, state) -> bool:
        failures.append(state.data)
        weights.write_bytes(complete)
        return transient(task, task_run, state)

    source = Source(ref=str(source_dir), name="tiny", path=str(source_dir), content_hash=content_hash(tiny_model_dir))
    attempt = quantize_method.with_options(retry_condition_fn=copy_finishes_then_decide, retry_delay_seconds=0,
                                           refresh_cache=True)
    state = attempt(source, "int8wo", return_state=True)
    assert state.is_completed(), state.message
    assert len(failures) == 1 and not isinstance(failures[0], ValueError), failures
    variant = state.result()
    assert variant.method == "int8wo" and Path(variant.path, "quantgate.json").is_file()
    with get_client(sync_client=True) as client:
        run = client.read_task_run(state.state_details.task_run_id)
    assert run.run_count == 2 and TASK_RETRIES >= 1


def test_a_release_killed_after_quantization_resumes_without_quantizing_again(prefect_api, tiny_model_dir,
                                                                              policies, tmp_path):
    """A release process is SIGKILLed once its quantization finished; the rerun takes the persisted
    quantization result (task state Cached) and the variant on disk is not rebuilt."""
    import os
    import subprocess
    import sys

    from prefect import get_client
    from prefect.client.schemas.filters import (
        TaskRunFilter,
        TaskRunFilterName,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL

    options = dict(methods=["fp4"], limit=4, suites=FAST_SUITES, canary_requests=8, approve="auto")
    code = ("from flows.release import release_flow\n"
            f"release_flow(model={str(tiny_model_dir)!r}, policy={policies['pass']!r}, **{options!r})\n")
    log = tmp_path / "killed-release.log"
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    done = None
    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 240
        while done is None and time.monotonic() < deadline and proc.poll() is None:
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(
                name=TaskRunFilterName(like_="quantize"),
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.COMPLETED]))))
            done = next((r for r in runs if r.flow_run_id is not None and r.start_time
                         and r.start_time.timestamp() >= started), None)
            time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=30)
    assert done is not None, f"the quantization never finished in the first run:\n{log.read_text()[-3000:]}"
    assert done.state.name == "Completed"  # it really quantized the first time

    from flows.release import release_flow

    variants = list((Path(os.environ["QUANTGATE_HOME"]) / "variants").glob("*-fp4"))
    assert len(variants) == 1
    manifest = variants[0] / "quantgate.json"
    stamp = (manifest.stat().st_mtime_ns, manifest.read_text())
    s = release_flow(model=str(tiny_model_dir), policy=policies["pass"], **options)
    states = {t.name.split("-")[0]: t.state.name for t in _task_runs(s["flow_run_id"])}
    assert states["quantize"] == "Cached"
    assert (manifest.stat().st_mtime_ns, manifest.read_text()) == stamp
    assert s["rows"][1]["name"] == "fp4" and s["rows"][1]["gates_passed"] is True


def test_release_cli_rejects_bad_input_before_any_run(prefect_api, capsys, tmp_path):
    from quantgate.cli import main

    cases = [
        (["release", "--limit", "0"], "limit must be >= 1"),
        (["release", "--methods", "int8,int3"], "int3"),
        (["release", "--model", str(tmp_path / "nowhere")], "unknown model reference"),
        (["release", "--policy", str(tmp_path / "missing.yaml")], "policy file not found"),
        (["release", "--suites", "accuracy,vibes"], "unknown task or suite 'vibes'"),
        (["approve", "not-a-run", "--comment", "ok"], "not a Prefect flow run id"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
