"""flows/watch.py and the model-change event's payload: what counts as a new model, and bad options refused
(no Prefect API needed: the event-triggered deployment itself is tested in test_flows.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    return d


def test_watch_reports_a_settled_content_change_once(tmp_path):
    from flows.watch import ModelWatcher

    model = model_dir(tmp_path)
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

    model = model_dir(tmp_path)
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


def test_event_payload_rejects_bad_options():
    from flows.deploy import event_payload

    with pytest.raises(ValueError, match="--approve must be one of"):
        event_payload(["int8"], None, "sometimes", None)
    with pytest.raises(ValueError, match="--limit must be >= 1"):
        event_payload(["int8"], None, "auto", 0)
