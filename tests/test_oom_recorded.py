"""An OOM kill is a recorded failure (issue 45): a stage run in a child process (flows/stage_process.py) that
the OS kills raises `StageKilled` in the parent, and the release run ends FAILED at once, naming the stage,
the signal and the child's peak memory, with no alias moved.

The children here are spawned: each imports this module (by its name, as pytest put tests/ on sys.path), so
it imports nothing heavy at the top.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from flows.stage_process import TAG_FAILED_PEAK_RSS_MB, TAG_FAILED_STAGE, StageKilled, run_stage_in_child


def _kill_self(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer sends: no handler, no finally runs


def _grow_then_kill(n_bytes: int) -> None:
    block = bytearray(n_bytes)  # zeroed, so every page is touched and resident
    time.sleep(1.0)  # the parent reads the high-water mark meanwhile
    del block
    _kill_self()


def _add(a: int, b: int) -> int:
    return a + b


def _refuse(what: str) -> None:
    raise ValueError(f"bad input: {what}")


def test_a_child_killed_by_sigkill_raises_stage_killed_naming_the_stage_and_signal():
    with pytest.raises(StageKilled) as caught:
        run_stage_in_child("quantize int8wo", _kill_self, "/models/x", "int8wo")
    killed = caught.value
    assert (killed.stage, killed.signal) == ("quantize int8wo", signal.SIGKILL)
    assert "'quantize int8wo'" in str(killed) and "SIGKILL" in str(killed) and "out-of-memory" in str(killed)
    assert killed.tags()[TAG_FAILED_STAGE] == "quantize int8wo"
    again = pickle.loads(pickle.dumps(killed))  # Prefect persists a failed task's exception
    assert (again.stage, again.signal, again.peak_bytes) == (killed.stage, killed.signal, killed.peak_bytes)


def test_the_peak_names_what_the_child_held_when_it_was_killed():
    with pytest.raises(StageKilled) as caught:
        run_stage_in_child("grow", _grow_then_kill, 200 * 2**20)
    assert caught.value.peak_bytes >= 200 * 2**20
    assert float(caught.value.tags()[TAG_FAILED_PEAK_RSS_MB]) >= 200 * 2**20 / 1e6


def test_a_result_and_an_exception_come_back_as_in_process():
    assert run_stage_in_child("add", _add, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad input: x") as caught:  # the type the retry rule reads
        run_stage_in_child("refuse", _refuse, "x")
    assert any("in the child process of stage 'refuse'" in note for note in caught.value.__notes__)


def test_a_script_without_a_main_guard_is_not_run_again_in_the_child(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import os\nfrom flows.stage_process import run_stage_in_child\n"
                      "print('ran', run_stage_in_child('pid', os.getpid) != os.getpid())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ran", "True"]  # once, in the parent; the child ran the stage only


# ---- the release flow ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_a_release_whose_quantize_child_is_killed_ends_failed_naming_the_stage(prefect_api, store, tiny_model_dir,
                                                                              monkeypatch):
    from flows import measuring
    from flows.release import model_name, release_flow
    from gates.records.orphans import TAG_FAILURE
    from gates.records.tracking import experiment_name, get_client

    monkeypatch.setattr(measuring, "quantize", _kill_self)  # the child the flow starts kills itself
    with pytest.raises(StageKilled, match="quantize int8wo"):
        release_flow(model=str(tiny_model_dir), methods=["int8wo"], limit=2, suites=["facts_mc"], approve="auto",
                     fresh=True)
    client = get_client()
    experiment = client.get_experiment_by_name(experiment_name(model_name(str(tiny_model_dir), tiny_model_dir)))
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.`quantgate.kind` = 'release'")
    assert run.info.status == "FAILED"  # at once, not at the next release's orphan sweep
    tags = run.data.tags
    assert tags[TAG_FAILED_STAGE] == "quantize int8wo" and float(tags[TAG_FAILED_PEAK_RSS_MB]) >= 0
    assert "SIGKILL" in tags[TAG_FAILURE]
    assert [m.name for m in client.search_registered_models() if m.aliases] == []  # no alias moved
    from prefect import get_client as prefect_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with prefect_client(sync_client=True) as prefect:
        (task_run,) = prefect.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="quantize")))
    assert task_run.state.is_failed() and task_run.run_count == 1  # a kill is not retried (it would recur)
