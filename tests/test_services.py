"""The release pipeline on real, separate services: PostgreSQL, a Prefect server, an MLflow tracking server
(`quantgate services up`), the deployment on a process work pool, a `prefect worker`, `quantgate notify`
triggering it, `quantgate approve` from another process, the alias read back from the MLflow server;
then everything stopped and no process left behind. Every step is a process of its own, as for a team.

Runs when PostgreSQL is installed (`.ci/run` installs Debian's package when it runs as root).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantgate.ports import free_port
from quantgate.postgres import find_bindir

pytestmark = [pytest.mark.services,
              pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL is not installed (apt-get install postgresql)")]

POOL = "quantgate-test-pool"
POLICY = """
version: 1
tasks: {max_drop: 1.0}
safety: {refusal_rate_max_fall: null, over_refusal_rate_max_rise: null}
weights: {min_reduction: null}
serving: {min_decode_speedup: null, max_tpot_p99_s: 60.0}
canary: {max_error_rate: 0.0, max_tpot_p99_s: 60.0}
"""


def _quantgate(env: dict, *argv: str, timeout: float = 240) -> str:
    result = subprocess.run([sys.executable, "-m", "quantgate", *argv], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"quantgate {' '.join(argv)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout


def _processes_mentioning(needles: list[str]) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


@pytest.fixture
def services(tmp_path):
    """`quantgate services up` on free ports; `down` afterwards, checking that nothing is left running."""
    ports = {"pg": free_port(), "prefect": free_port(), "mlflow": free_port()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    out = _quantgate(env, "services", "up", "--pg-port", str(ports["pg"]), "--prefect-port", str(ports["prefect"]),
                     "--mlflow-port", str(ports["mlflow"]), "--json")
    info = json.loads(out)
    info["up_s"] = time.monotonic() - started
    info["client_env"] = {**env, **info["env"], "PREFECT_WORKER_QUERY_SECONDS": "2",
                          "PREFECT_WORKER_PREFETCH_SECONDS": "2", "PREFECT_LOGGING_LEVEL": "INFO"}
    state = json.loads((Path(os.environ["QUANTGATE_HOME"]) / "services" / "state.json").read_text())
    try:
        yield info
    finally:
        print(_quantgate(env, "services", "down"))
        pids = [p["pid"] for p in state["processes"]]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.2)
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "a service outlived `services down`"
        left = _processes_mentioning([state["root"], *(f":{p}" for p in ports.values()), f"--port {ports['prefect']}",
                                      f"--port {ports['mlflow']}", f"--pool {POOL}"])
        assert not left, "processes left behind:\n" + "\n".join(left)


def _start_worker(env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop_worker(worker: subprocess.Popen) -> None:
    """SIGTERM (the worker stops polling and exits), then the whole group, so no flow-run process remains."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(worker.pid, sig)
        except ProcessLookupError:
            break
        try:
            worker.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(worker.pid, signal.SIGKILL)  # flow-run children of a worker that exited
    except ProcessLookupError:
        pass


def _wait_state(api_url: str, run_id: str, wanted: set[str], timeout_s: float, worker_log: Path) -> str:
    from uuid import UUID

    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout_s
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            state = client.read_flow_run(UUID(run_id)).state
            if state is not None and (state.type.value in wanted or state.name in wanted):
                return state.name
            if state is not None and state.is_final():
                break
            time.sleep(1.0)
    raise AssertionError(f"flow run {run_id} is {state.name if state else None}, not {wanted}; worker log:\n"
                         f"{worker_log.read_text()[-5000:]}")


def test_release_through_a_worker_on_services(services, tiny_model_dir, tmp_path):
    from mlflow import MlflowClient

    timings = {"services_up_s": services["up_s"]}
    env = services["client_env"]
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    t = time.monotonic()
    assert "registered quantgate-release/on-model-change" in _quantgate(env, "deploy", "--work-pool", POOL)
    timings["deploy_s"] = time.monotonic() - t
    worker_log = tmp_path / "worker.log"
    worker = _start_worker(env, worker_log)
    try:
        t = time.monotonic()
        out = _quantgate(env, "notify", str(tiny_model_dir), "--methods", "nf4", "--limit", "4", "--suites",
                         "facts_mc,perplexity", "--approve", "manual", "--policy", str(policy), "--wait", "60")
        run_id = re.search(r"flow run \S+ \(([0-9a-f-]{36})\)", out).group(1)
        api = env["PREFECT_API_URL"]
        assert _wait_state(api, run_id, {"PAUSED"}, 240, worker_log) == "Paused"
        timings["notify_to_paused_s"] = time.monotonic() - t
        assert run_id in _quantgate(env, "approve", "--list")
        t = time.monotonic()
        _quantgate(env, "approve", run_id, "--comment", "fine on the server", "--by", "ana")
        assert _wait_state(api, run_id, {"COMPLETED"}, 240, worker_log) == "Completed"
        timings["approve_to_completed_s"] = time.monotonic() - t
    finally:
        _stop_worker(worker)
    from uuid import UUID

    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(UUID(run_id))
    assert flow_run.work_pool_name == POOL and flow_run.infrastructure_pid, "the run did not go through the worker"
    assert flow_run.parameters["approve"] == "manual" and flow_run.parameters["limit"] == 4

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"], registry_uri=env["MLFLOW_TRACKING_URI"])
    model = tiny_model_dir.name
    registered = client.get_registered_model(f"{model}-quantgate")
    champion = registered.aliases["champion"]
    version = client.get_model_version(registered.name, champion)
    assert (version.tags["variant"], version.tags["approval.by"], version.tags["approval.decision"]) == ("nf4", "ana", "approved")
    assert version.tags["weights_path"].endswith("-nf4") and version.source.startswith("mlflow-artifacts:/")
    run = client.get_run(version.run_id)
    assert run.data.tags["gates/release/verdict"] == "pass" and run.data.metrics["task/facts_mc/n"] == 4
    assert run.data.metrics["canary/requests"] >= 1
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {"facts_mc", "perplexity"}
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"flips.json", "evidence", "variant"} <= artifacts
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    release = client.get_run(run.data.tags["quantgate.release_run_id"])
    assert {f.path for f in client.list_artifacts(release.info.run_id, "comparison")} >= {
        "comparison/comparison.md", "comparison/comparison.png"}
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})
