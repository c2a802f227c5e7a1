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

from flows.runtime import prepare

prepare()


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


# ---- watching models --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    return d


def test_watch_reports_a_settled_content_change_once(tmp_path):
    from flows.watch import ModelWatcher

    model = _model_dir(tmp_path)
    clock = FakeClock()
    watcher = ModelWatcher([model], debounce_s=5.0, clock=clock)
    assert watcher.poll() == []
    (model / "model.safetensors").write_bytes(b"\x01" * 64)  # a write starts
    assert watcher.poll() == []  # pending, not settled
    clock.now += 3
    (model / "model.safetensors").write_bytes(b"\x02" * 80)  # still being written
    assert watcher.poll() == []
    clock.now += 4  # 4 s since the last write: still inside the debounce window
    assert watcher.poll() == []
    clock.now += 2
    changes = watcher.poll()
    assert [c.path for c in changes] == [model.resolve()]
    assert changes[0].old_digest != changes[0].new_digest
    clock.now += 10
    assert watcher.poll() == []  # reported once


def test_watch_ignores_a_touch_and_rejects_what_it_cannot_watch(tmp_path):
    import os

    from flows.watch import ModelWatcher

    model = _model_dir(tmp_path)
    clock = FakeClock()
    watcher = ModelWatcher([model], debounce_s=1.0, clock=clock)
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert watcher.poll() == []
    clock.now += 2
    assert watcher.poll() == []  # same bytes: not a new model
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a HF model directory"):
        ModelWatcher([tmp_path / "empty"])
    with pytest.raises(ValueError, match="does not exist"):
        ModelWatcher([tmp_path / "missing"])
    with pytest.raises(ValueError, match="GGUF file not found"):
        ModelWatcher([tmp_path / "missing.gguf"])


# ---- run on model change ----------------------------------------------------------------------------


def test_model_change_event_triggers_the_deployment_with_its_parameters(prefect_api, tmp_path):
    """watch sees the model change -> notify emits quantgate.model.changed -> the trigger creates a run."""
    from prefect import get_client

    from flows.deploy import build_deployment, event_payload, notify
    from flows.watch import ModelWatcher

    build_deployment("test-on-change").apply()
    model = _model_dir(tmp_path)
    watcher = ModelWatcher([model], debounce_s=0.0)
    (model / "model.safetensors").write_bytes(b"\x07" * 64)
    assert watcher.poll() == []
    (change,) = watcher.poll()
    payload = event_payload(["nf4"], None, "manual", 3, content_hash=change.new_digest)
    result = notify(str(change.path), payload, wait_s=60, deployment="test-on-change")
    assert result.deployment == "quantgate-release/test-on-change"
    assert result.flow_run_id is not None, "the event trigger created no flow run within 60 s"
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(uuid.UUID(result.flow_run_id))
    assert run.parameters == {"model": str(model.resolve()), "methods": ["nf4"], "policy": None,
                              "approve": "manual", "limit": 3}


def test_event_payload_rejects_bad_options():
    from flows.deploy import event_payload

    with pytest.raises(ValueError, match="--approve must be one of"):
        event_payload(["int8"], None, "sometimes", None)
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        event_payload(["int8"], None, "auto", 0)
