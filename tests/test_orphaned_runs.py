"""A release killed with SIGKILL leaves its MLflow runs RUNNING; the next release of that model marks them
FAILED with the reason, and leaves alone the releases whose process still runs or cannot be judged here.
Real subprocesses, real MLflow sqlite store in a temp dir, the flow's own start-release task."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

MODEL = "orphan-test-model"

# A release process: opens its release run and a variant run that is still being recorded, then works on.
RELEASE = f"""
from gates.records.tracking import TAG_PARENT, TAG_RELEASE, ensure_experiment, get_client, start_release
release = start_release({MODEL!r}, "hash0")
client = get_client()
child = client.create_run(ensure_experiment({MODEL!r}, client), run_name="int8",
                          tags={{TAG_PARENT: release, TAG_RELEASE: release}})
print(release, child.info.run_id, flush=True)
import time
time.sleep(600)
"""


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _start_release_processes(n: int) -> list[tuple[subprocess.Popen, str, str]]:
    procs = [subprocess.Popen([sys.executable, "-c", RELEASE], stdout=subprocess.PIPE, text=True, env=os.environ)
             for _ in range(n)]
    started = []
    for proc in procs:
        line = proc.stdout.readline().split()
        assert len(line) == 2, f"the release process printed {line!r} (exit {proc.poll()})"
        started.append((proc, line[0], line[1]))
    return started


def _fake_release(client, tags: dict[str, str]) -> str:
    from gates.records.tracking import TAG_KIND, TAG_MODEL, ensure_experiment

    return client.create_run(ensure_experiment(MODEL, client), tags={TAG_KIND: "release", TAG_MODEL: MODEL,
                                                                     **tags}).info.run_id


def test_the_next_release_fails_runs_whose_process_is_gone_and_leaves_live_ones(store):
    from gates.records.orphans import (
        TAG_FAILURE,
        TAG_MACHINE,
        TAG_PID,
        TAG_PID_STARTED,
        ReleaseProcess,
        fail_orphaned_releases,
    )
    from gates.records.tracking import get_client

    client = get_client()
    client.search_experiments()  # creates the store's tables once: two processes doing it at once collide
    (killed, killed_run, killed_child), (alive, alive_run, alive_child) = _start_release_processes(2)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        here = ReleaseProcess.current()
        # pid alive but not the process that started the release: the pid was reused
        reused = _fake_release(client, {**here.tags(), TAG_PID_STARTED: f"{here.started - 3600:.3f}"})
        elsewhere = _fake_release(client, {**here.tags(), TAG_PID: str(killed.pid), TAG_MACHINE: "other-boot/1"})
        unrecorded = _fake_release(client, {})

        from flows.release import Source, start_release

        new_run = start_release.fn(Source(MODEL, MODEL, "/nowhere", "hash1"), {"methods": ["int8"]})

        status = {name: client.get_run(run_id).info.status for name, run_id in [
            ("killed", killed_run), ("killed_child", killed_child), ("alive", alive_run),
            ("alive_child", alive_child), ("reused", reused), ("elsewhere", elsewhere),
            ("unrecorded", unrecorded), ("new", new_run)]}
        assert status == {"killed": "FAILED", "killed_child": "FAILED", "alive": "RUNNING", "alive_child": "RUNNING",
                          "reused": "FAILED", "elsewhere": "RUNNING", "unrecorded": "RUNNING", "new": "RUNNING"}
        reason = client.get_run(killed_run).data.tags[TAG_FAILURE]
        assert reason.startswith(f"orphaned: the release process (pid {killed.pid} on {here.host}, started ")
        assert f"is gone; marked FAILED by the next release of {MODEL} at " in reason
        assert client.get_run(killed_child).data.tags[TAG_FAILURE] == f"its release {killed_run} is {reason}"
        assert f"pid {os.getpid()} " in client.get_run(reused).data.tags[TAG_FAILURE]
        assert TAG_FAILURE not in client.get_run(alive_run).data.tags
        new_owner = ReleaseProcess.from_tags(client.get_run(new_run).data.tags)
        assert (new_owner.pid, new_owner.host, new_owner.started) == (os.getpid(), here.host, here.started)
        assert client.get_run(killed_run).info.end_time is not None
        assert fail_orphaned_releases() == []  # every quantgate model: nothing left that this host can judge
        assert fail_orphaned_releases("never-released") == []
    finally:
        alive.kill()
        alive.wait(timeout=30)



def test_two_releases_creating_the_experiment_at_once_share_it(store, monkeypatch):
    """The other process inserts the experiment between our lookup and our insert: we take theirs."""
    from gates.records.tracking import ensure_experiment, experiment_name, get_client

    client = get_client()
    theirs = ensure_experiment("race-model", client)
    real_lookup, calls = client.get_experiment_by_name, []

    def lookup(name):
        calls.append(name)
        return None if len(calls) == 1 else real_lookup(name)  # the first lookup ran before their insert

    monkeypatch.setattr(client, "get_experiment_by_name", lookup)
    assert ensure_experiment("race-model", client) == theirs
    assert calls == [experiment_name("race-model")] * 2
