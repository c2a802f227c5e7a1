"""flows/ on a Ray cluster (issue 46): a local 2-node cluster (`ray.cluster_utils.Cluster`, one CPU and a resource of
its own per node) that the release checks before it runs anything on it.

In `make test` (well under a minute on 2 cores): every node sees the driver's QUANTGATE_HOME and numerics; a node
with another home is refused, named. Opt-in, `QUANTGATE_RAY_RELEASE=1 .venv/bin/pytest tests/test_ray_release.py`
(several minutes on 2 cores): the default model released on the cluster and in one process, per-item outputs and
verdicts compared; a Ray worker killed while it evaluates, the release run to its end or failed cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from quantgate import settings

pytest.importorskip("ray")
pytest.importorskip("prefect_ray")

from flows import ray_cluster  # noqa: E402

HEAVY = pytest.mark.skipif(settings.RAY_RELEASE.raw() != "1",
                           reason="set QUANTGATE_RAY_RELEASE=1 for the release on the cluster (minutes on 2 cores)")


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine, one CPU each and a resource naming each; their temp dir is removed after."""
    from ray._common.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="qgray-", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    # Cluster writes its address to /tmp/ray/ray_current_cluster whatever temp_dir says, and fails on a machine
    # that never ran Ray (a fresh CI runner) because it does not create that folder
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                      "include_dashboard": False, "temp_dir": temp})
    try:
        c.add_node(num_cpus=1, resources={"node_b": 1})
        yield c
    finally:
        ray_cluster.disconnect()
        c.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def connected(cluster):
    """This process connected to the cluster as a release's driver connects (one Ray job: its workers serve
    every check below)."""
    seen = ray_cluster.connect(cluster.address, "cpu")
    yield seen
    ray_cluster.disconnect()


def test_a_fleet_started_here_gets_its_own_ray_beside_another_cluster(cluster):
    """`quantgate fleet up` without an address starts a Ray of its own: a bare `ray.init` attached to this
    cluster (it names itself in /tmp/ray) and refused num_cpus there; test_fleet.py beside this module failed so."""
    import subprocess
    import sys

    code = ("from fleet.app import connect; import ray; connect(None, 1); "
            "print(ray.get_runtime_context().gcs_address)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] != cluster.address


def test_every_node_sees_the_drivers_home_and_numerics(cluster, connected):
    assert len(connected.nodes) == 2 and connected.task_cpus == 1
    assert {n.home for n in connected.nodes} == {str(settings.home().resolve())}
    assert all(n.marker for n in connected.nodes)
    assert "the flow's process" in connected.driver and "Ray node" in connected.driver
    tags = connected.tags()
    assert tags[ray_cluster.TAG_ADDRESS] == cluster.address and tags[ray_cluster.TAG_DRIVER] == connected.driver
    assert tags[ray_cluster.TAG_NODES].count("Ray node") == 2
    assert not list(ray_cluster.marker_dir().glob("check-*")), "the marker is removed after the check"


def test_a_node_with_another_home_is_refused_by_name(cluster, connected, tmp_path):
    other = tmp_path / "another-home"
    node = cluster.add_node(num_cpus=1, env_vars={"QUANTGATE_HOME": str(other)})
    try:
        with pytest.raises(ray_cluster.ClusterRefused) as refused:
            ray_cluster.check(cluster.address, "cpu", {})
    finally:
        cluster.remove_node(node)
    message = str(refused.value)
    assert f"sees QUANTGATE_HOME={other.resolve()}" in message and node.node_id[:12] in message
    assert message.count("sees QUANTGATE_HOME") == 1, "only the odd node is named"


def test_a_stage_no_node_has_room_for_is_refused(cluster, connected):
    with pytest.raises(ray_cluster.ClusterRefused, match="measure baseline needs 1048576.00 GiB"):
        ray_cluster.check(cluster.address, "cpu", {"measure baseline": 2**50})


# ---- opt-in: the default model released on the cluster ---------------------------------------------------

SUITES = ["facts_mc", "arith", "perplexity", "arc_easy", "harmbench"]  # scored and generated, ours and real
POLICY = """
version: 1
tasks: {max_drop: 0.5}
safety: {refusal_rate_max_fall: 0.5, over_refusal_rate_max_rise: null}
weights: {min_reduction: 0.3}
serving: {min_decode_speedup: 0.5, min_prefill_speedup: 0.5, decode_batches: [1], max_tpot_p99_s: 60.0}
speed: {prefill_tokens: 128, decode_context: 64, decode_steps: 16, long_context: null, look_every: 3, max_rounds: 3}
sensitivity: {tasks: report, safety: report, serving: report}
fidelity: {max_kl: 1.0, max_flip_rate: 1.0, chunks: 2, chunk_tokens: 64}
canary: {max_error_rate: 0.0, max_tpot_p99_s: 60.0, min_tpot_speedup: null}
"""
RELEASE = dict(model="smollm2-135m", methods=["int8wo"], limit=4, suites=SUITES, canary_requests=6, approve="auto")


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ray-policy") / "policy.yaml"
    path.write_text(POLICY)
    return str(path)


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _items(summary: dict) -> dict:
    """Every model's per-item outputs (eval samples, fidelity positions) from the files the release measured."""
    from gates.records.tracking import get_client

    client, out = get_client(), {}
    for row in summary["rows"]:
        local = Path(client.download_artifacts(row["run_id"], "evidence", tempfile.mkdtemp(prefix="qg-ray-art-")))
        samples = {}
        for f in sorted(local.rglob("samples/*.jsonl")):
            samples[f"{f.parent.parent.name}/{f.stem}"] = [json.loads(line) for line in f.read_text().splitlines()
                                                           if line.strip()]
        fidelity = sorted(local.rglob("fidelity.json"))
        out[row["name"]] = {"samples": samples,
                            "fidelity": json.loads(fidelity[0].read_text()) if fidelity else None}
        shutil.rmtree(local.parent, ignore_errors=True)
    return out


TIMED = ("serve/", "speed/", "canary/")  # gates on timings: two releases in one process differ there too


def _verdicts(summary: dict) -> dict:
    """Each variant's gate verdicts and observed values, but for the gates on timings."""
    from gates.records.evaluation import read_evaluation

    out = {}
    for row in summary["rows"][1:]:
        ev = read_evaluation(row["run_id"], "release")
        out[row["name"]] = {r.name: (r.verdict, r.observed) for r in ev.results
                            if not r.name.startswith(TIMED)}
    return out


@pytest.fixture(scope="module")
def both_releases(prefect_api, cluster, policy) -> tuple[dict, dict, float, float]:
    """One process, then the cluster, each from scratch. The one process runs at the Ray tasks' thread count (each
    node has 1 CPU, so each task 1 torch thread): torch's fp32 reductions depend on the thread count (at 2 threads
    against 1, WinoGrande's log-likelihoods moved in the 6th digit here), so one process at 2 threads is another
    numeric setting, as another dtype would be."""
    import torch

    from flows.release import release_flow

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        here = release_flow(policy=policy, fresh=True, **RELEASE)
        one_s = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    here_items, here_verdicts = _items(here), _verdicts(here)
    started = time.perf_counter()
    there = release_flow(policy=policy, fresh=True, ray_address=cluster.address, **RELEASE)
    ray_s = time.perf_counter() - started
    return (here, here_items, here_verdicts), (there, _items(there), _verdicts(there)), one_s, ray_s


@HEAVY
def test_the_release_on_ray_gives_one_process_items_and_verdicts(both_releases):
    (here, here_items, here_verdicts), (there, there_items, there_verdicts), one_s, ray_s = both_releases
    print(f"one process {one_s:.1f} s, on the 2-node cluster {ray_s:.1f} s")
    assert there_items.keys() == here_items.keys() == {"baseline", "int8wo"}
    for model in here_items:
        assert there_items[model]["samples"].keys() == here_items[model]["samples"].keys()
        for task, rows in here_items[model]["samples"].items():
            assert there_items[model]["samples"][task] == rows, f"{model} {task}: per-item outputs differ"
        assert there_items[model]["fidelity"] == here_items[model]["fidelity"], f"{model}: fidelity differs"
    differ = {(m, g): (here_verdicts[m].get(g), there_verdicts[m].get(g)) for m in here_verdicts
              for g in here_verdicts[m].keys() | there_verdicts[m].keys()
              if here_verdicts[m].get(g) != there_verdicts[m].get(g)}
    assert not differ, f"verdicts that differ (one process, Ray): {differ}"
    assert len(here_verdicts["int8wo"]) >= len(SUITES) + 3, "task, safety, weights and fidelity gates compared"
    assert [r["gates_passed"] for r in there["rows"]] == [r["gates_passed"] for r in here["rows"]]
    assert "on " in there["machine"] and "Ray node" in there["machine"], "the speed rounds' node is named"


def _ray_workers(title: str) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith(f"ray::{title}"):
            found.append(p.info["pid"])
    return found


@HEAVY
def test_a_worker_killed_mid_release_is_retried_or_the_release_fails_cleanly(both_releases, cluster, policy):
    from flows.release import release_flow
    from gates.records import registry
    from gates.records.tracking import experiment_name, get_client

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = release_flow(policy=policy, fresh=True, ray_address=cluster.address, **RELEASE)
        except BaseException as exc:  # noqa: BLE001 - the outcome the test judges
            outcome["error"] = exc

    before = registry.aliases("smollm2-135m")
    thread = threading.Thread(target=run)
    thread.start()
    killed, deadline = None, time.monotonic() + 600
    while killed is None and thread.is_alive() and time.monotonic() < deadline:
        pids = _ray_workers("evaluate-suite")
        if pids:
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    thread.join(timeout=900)
    assert killed is not None, "no Ray worker evaluating a suite was seen"
    if "summary" in outcome:  # Ray ran the killed task again: the release is whole
        s = outcome["summary"]
        assert get_client().get_run(s["release_run_id"]).info.status == "FINISHED"
        print(f"worker {killed} killed; its task ran again; outcome: {s['outcome']}")
    else:  # failed cleanly: the run FAILED, no alias moved
        client = get_client()
        runs = client.search_runs([client.get_experiment_by_name(experiment_name("smollm2-135m")).experiment_id],
                                  filter_string="tags.`quantgate.kind` = 'release'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        assert runs[0].info.status == "FAILED", outcome["error"]
        assert registry.aliases("smollm2-135m") == before
        print(f"worker {killed} killed; the release failed cleanly: {outcome['error']!r}")
