"""Release runs whose process died: every release run records the process that runs it, and the next
release of that model marks the runs whose process is gone FAILED (with the reason), children too.

A process is judged only on the machine it ran on: same kernel boot and same pid namespace, so a pid
means the same thing here as there. The pid's start time catches a pid reused by another process.
Runs from another machine (or container) and runs that recorded no process are left alone: nothing
here can tell whether they still run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gates.records.release_process import TAG_HOST, TAG_MACHINE, TAG_PID, TAG_PID_STARTED, ReleaseProcess  # noqa: F401 (re-exported)
from gates.records.tracking import TAG_KIND, TAG_RELEASE, experiment_name, get_client

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

TAG_FAILURE = "quantgate.failure_reason"


def prepare_sweep() -> None:
    """Import now what a sweep needs (seconds of CPU), for a process that must sweep fast later."""
    import mlflow.tracking  # noqa: F401

    from gates.records.tracking import is_local_store

    if is_local_store():
        import mlflow.store.model_registry.sqlalchemy_store  # noqa: F401
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


def fail_orphaned_releases(model_name: str | None = None, found_by: str = "the next release",
                           client: MlflowClient | None = None) -> list[str]:
    """Mark FAILED the RUNNING release runs (of `model_name`, or of every quantgate model) whose process
    on this machine is gone, and their RUNNING child runs; returns the release run ids marked."""
    client = client or get_client()
    failed = []
    for run in _running_releases(client, model_name):
        owner = ReleaseProcess.from_tags(run.data.tags)
        if owner is None or not owner.judged_here() or owner.is_alive():
            continue
        now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        reason = f"orphaned: the release process ({owner.describe()}) is gone; marked FAILED by {found_by} at {now}"
        _fail(client, run, reason)
        failed.append(run.info.run_id)
    return failed


def _running_releases(client: MlflowClient, model_name: str | None) -> list[Run]:
    if model_name is not None:
        experiment = client.get_experiment_by_name(experiment_name(model_name))
        ids = [experiment.experiment_id] if experiment is not None else []
    else:
        ids = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'quantgate/%'")]
    if not ids:
        return []
    return client.search_runs(ids, filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG_KIND}` = 'release'",
                              max_results=1000)


def _fail(client: MlflowClient, release: Run, reason: str) -> None:
    """Children first: a sweep cut short leaves the release RUNNING, so the next one finishes the job."""
    release_id = release.info.run_id
    children = client.search_runs([release.info.experiment_id], max_results=1000,
                                  filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG_RELEASE}` = '{release_id}'")
    for child in children:
        client.set_tag(child.info.run_id, TAG_FAILURE, f"its release {release_id} is {reason}")
        client.set_terminated(child.info.run_id, status="FAILED")
    client.set_tag(release_id, TAG_FAILURE, reason)
    client.set_terminated(release_id, status="FAILED")
