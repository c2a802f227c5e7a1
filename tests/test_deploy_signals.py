"""`quantgate deploy` stops within seconds of SIGTERM (a service manager) and of SIGINT to its process
group (Ctrl-C), ending the release in flight: Prefect run Cancelled/Crashed, MLflow release run FAILED,
no process left behind.

Real subprocesses with their own PREFECT_HOME / QUANTGATE_HOME / MLflow store. Both deploys start at
once to save wall time: the SIGTERM one on the test's Prefect API (so the run's final state can be read
after the deploy is gone), the SIGINT one on the temporary API it starts itself (the default setup).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

STOP_WITHIN_S = 10.0
FLOW_DEPLOYMENT = "quantgate-release/on-model-change"


@dataclass
class Deploy:
    proc: subprocess.Popen
    home: Path

    @property
    def log(self) -> str:
        return (self.home / "deploy.log").read_text()

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.home / 'mlflow.db'}"

    def wait_serving(self, timeout_s: float = 180.0) -> str:
        """The Prefect API URL it serves on, once its deployment is registered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = re.search(rf"serving {FLOW_DEPLOYMENT} on the Prefect API (\S+):", self.log)
            if found:
                return found.group(1)
            time.sleep(0.2)
        raise AssertionError(f"deploy never served (exit {self.proc.poll()}):\n{self.log[-3000:]}")

    def release_statuses(self) -> list[str]:
        from mlflow import MlflowClient

        if not self._store_has_runs():
            return []  # a client now would race the release creating the store's tables
        client = MlflowClient(tracking_uri=self.tracking_uri)
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, "tags.`quantgate.kind` = 'release'") if experiments else []
        return [run.info.status for run in runs]

    def _store_has_runs(self) -> bool:
        import sqlite3

        try:
            with sqlite3.connect(f"file:{self.home / 'mlflow.db'}?mode=ro", uri=True) as db:
                return db.execute("SELECT count(*) FROM runs").fetchone()[0] > 0
        except sqlite3.Error:
            return False

    def wait_release_running(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.release_statuses() == ["RUNNING"]:
                return
            time.sleep(0.5)
        raise AssertionError(f"no release run went RUNNING (exit {self.proc.poll()}):\n{self.log[-3000:]}")

    def stop(self, sig: int, group: bool) -> tuple[int | None, float, list]:
        """Send `sig` (to the process group: what a terminal's Ctrl-C does); exit code, seconds, the
        processes that ran below it."""
        import psutil

        below = psutil.Process(self.proc.pid).children(recursive=True)
        start = time.monotonic()
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - start, below


def _start_deploy(home: Path, api_url: str | None) -> Deploy:
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(QUANTGATE_HOME=str(home), PREFECT_HOME=str(home / "prefect"),
               MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlflow.db'}", PREFECT_RUNNER_POLL_FREQUENCY="1")
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    with open(home / "deploy.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "quantgate", "deploy"], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    return Deploy(proc, home)


@pytest.fixture(scope="module")
def deploys(tmp_path_factory, tiny_model_dir):
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    root = tmp_path_factory.mktemp("deploy-signals")
    started = {"sigint": _start_deploy(root / "own-api", None)}
    try:
        with prefect_test_harness(server_startup_timeout=120):
            started["sigterm"] = _start_deploy(root / "test-api", PREFECT_API_URL.value())
            flow_runs = {"sigterm": _start_release(started["sigterm"], tiny_model_dir),
                         "sigint": _start_release(started["sigint"], tiny_model_dir)}  # both at once
            yield started, flow_runs
    finally:
        for d in started.values():  # what a failed test left running
            if d.proc.poll() is None:
                os.killpg(d.proc.pid, signal.SIGKILL)
                d.proc.wait(timeout=30)


def _start_release(deploy: Deploy, model_dir: Path) -> str:
    """A release of `model_dir` through `deploy`'s API: it runs for minutes unless stopped."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: deploy.wait_serving()}):
        run = run_deployment(FLOW_DEPLOYMENT, parameters={"model": str(model_dir), "methods": ["int8"]}, timeout=0)
    return str(run.id)


def _still_running(processes: list) -> list:
    import psutil

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in processes if running(p)]


def test_sigterm_stops_deploy_and_ends_the_release_in_flight(deploys):
    from prefect import get_client

    deploy, flow_run_id = deploys[0]["sigterm"], deploys[1]["sigterm"]
    deploy.wait_release_running()
    code, seconds, below = deploy.stop(signal.SIGTERM, group=False)
    assert code == 0 and seconds < STOP_WITHIN_S, f"exit {code} after {seconds:.1f} s:\n{deploy.log[-3000:]}"
    assert below and _still_running(below) == []
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    assert state.type.value in ("CANCELLED", "CRASHED"), (state, deploy.log[-3000:])
    assert deploy.release_statuses() == ["FAILED"]
    assert "quantgate deploy: stopped" in deploy.log


def test_ctrl_c_stops_deploy_and_ends_the_release_in_flight(deploys):
    deploy = deploys[0]["sigint"]
    deploy.wait_release_running()
    code, seconds, below = deploy.stop(signal.SIGINT, group=True)
    assert code == 0 and seconds < STOP_WITHIN_S, f"exit {code} after {seconds:.1f} s:\n{deploy.log[-3000:]}"
    assert len(below) >= 2 and _still_running(below) == []  # the flow run and its own API server
    assert deploy.release_statuses() == ["FAILED"]
    assert "quantgate deploy: stopped" in deploy.log
