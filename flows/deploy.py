"""Run the release flow when a model changes: a Prefect deployment with an event trigger.

`quantgate deploy` serves the release flow as the deployment `quantgate-release/on-model-change`,
triggered by the event `quantgate.model.changed`: resource id = the model reference, flow parameters
from the event's payload. `quantgate watch` and `quantgate notify` emit that event.

`quantgate deploy --work-pool POOL` instead registers the deployment on a process work pool of a Prefect
server (`PREFECT_API_URL`, e.g. from `quantgate services up`) and exits; `prefect worker start --pool
POOL`, one or more, on any machine with quantgate installed, run the triggered releases.

Without `PREFECT_API_URL`, every process has its own temporary API over the shared sqlite database, and
an event is judged by the API of the process that emitted it; `notify` therefore waits until the run it
triggered exists (it also tells you the run's id) before it exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.sorting import FlowRunSort
from prefect.deployments.runner import EntrypointType
from prefect.events import DeploymentEventTrigger, emit_event
from prefect.exceptions import ObjectNotFound
from prefect.runner import Runner
from prefect.workers.process import ProcessWorker

from flows.approval import APPROVE_MODES
from flows.runtime import deployment_env, shared_api
from flows.stopping import Stopper

EVENT_NAME = "quantgate.model.changed"
DEPLOYMENT_NAME = "on-model-change"
FLOW_NAME = "quantgate-release"
# Flow parameters an event may set (from its payload); `model` comes from the resource id.
EVENT_PARAMETERS = ("methods", "policy", "approve", "limit", "suites")


def release_trigger() -> DeploymentEventTrigger:
    parameters: dict[str, Any] = {"model": "{{ event.resource.id }}"}
    # A single `{{ expr }}` keeps the payload value's JSON type (list, int, null), not its string form.
    parameters.update({name: f"{{{{ event.payload.{name} }}}}" for name in EVENT_PARAMETERS})
    return DeploymentEventTrigger(
        name="release on model change",
        expect={EVENT_NAME},
        parameters=parameters,
    )


def build_deployment(name: str = DEPLOYMENT_NAME, work_pool: str | None = None, ray_address: str | None = None):
    """The release deployment; on a work pool its entrypoint is the module path `flows.release:release_flow`,
    so a worker anywhere quantgate is installed can load it (no source folder of ours needed).

    The flow-run process's environment: `release_flow` calls `prepare()` at its start; on a work pool the
    run also gets `deployment_env()` from its job variables, set before the process imports anything
    (served here, each run inherits this process's environment, which the CLI prepared). `ray_address`: every
    run spreads its per-model work over that Ray cluster (the flow's `ray_address` parameter; an event cannot
    change it), and refuses at its start, before any work, where the cluster cannot be reached."""
    from flows.release import release_flow  # late: torch, transformers, MLflow, only when deploying

    return release_flow.to_deployment(
        name=name,
        triggers=[release_trigger()],
        description=f"quantgate release, run on the event {EVENT_NAME!r} (see `quantgate watch` / `notify`)",
        tags=["quantgate"],
        work_pool_name=work_pool,
        entrypoint_type=EntrypointType.MODULE_PATH if work_pool else EntrypointType.FILE_PATH,
        job_variables={"env": deployment_env()} if work_pool else None,
        parameters={"ray_address": ray_address} if ray_address else None,
    )


def server_api_url() -> str:
    """The Prefect server a work pool lives on; a temporary per-process API cannot host one."""
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if not url:
        raise ValueError("a work pool needs a Prefect server: export PREFECT_API_URL "
                         "(`quantgate services up` prints it), or use `quantgate deploy` without --work-pool")
    return url


def ensure_work_pool(pool: str) -> str:
    """Create the process work pool `pool` when it is missing; returns its type (refuses a non-process one)."""
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_work_pool(pool)
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
            return "process"
    if existing.type != "process":
        raise ValueError(f"work pool {pool!r} is of type {existing.type!r}; quantgate deploys to a 'process' pool")
    return existing.type


def register_on_work_pool(pool: str, name: str = DEPLOYMENT_NAME, ray_address: str | None = None) -> str:
    """Register the deployment (and its event trigger) on `pool` of the Prefect server; returns its id.
    Workers (`prefect worker start --pool POOL`) run its flow runs; nothing runs in this process."""
    server_api_url()
    ensure_work_pool(pool)
    return str(build_deployment(name, work_pool=pool, ray_address=ray_address).apply(work_pool_name=pool))


def serve_deployment(name: str = DEPLOYMENT_NAME, on_serving: Callable[[str], None] | None = None,
                     ray_address: str | None = None) -> None:
    """Register the deployment and start its flow runs (each in a process of its own) until SIGINT or
    SIGTERM; `on_serving(api_url)` once it is registered. What a stop does: `flows.stopping`."""
    from gates.records.orphans import prepare_sweep  # late: MLflow; notify and watch import this module too

    prepare_sweep()  # now: on a stop, these imports would take the GIL from the runner for seconds
    stopper = Stopper()
    stopper.install()
    try:
        stopper.interruptible = True  # starting the API: nothing to lose
        with shared_api() as api:
            stopper.interruptible = False  # from here on a stop waits for a point where it is clean
            stopper.api_server_pid = api.server_pid
            runner = _runner(stopper)
            runner.add_deployment(build_deployment(name, ray_address=ray_address))
            if on_serving is not None:
                on_serving(api.url)
            if stopper.signum is None:
                asyncio.run(_serve(runner, stopper))
    except KeyboardInterrupt:  # a stop signal while the API started: nothing was in flight
        pass
    finally:
        stopper.finish()


async def _serve(runner, stopper) -> None:
    serving = asyncio.create_task(runner.start())
    while not runner.started and not serving.done():
        await asyncio.sleep(0.05)
    if runner.started:
        stopper.serving(runner)
    await serving


def _runner(stopper):
    class StoppableRunner(Runner):
        def handle_sigterm(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
            stopper.request(signum)  # Runner.start installs this one for SIGTERM

    return StoppableRunner()


def exit_at_once(code: int = 0) -> None:
    """After a stop, when everything is recorded: flush and leave without the interpreter's teardown,
    which takes seconds here (module teardown of Prefect, MLflow and their dependencies)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def event_payload(methods: list[str], policy: str | None, approve: str, limit: int | None,
                  suites: list[str] | None = None, **extra: Any) -> dict:
    """The full payload: every templated parameter is present, so the trigger never renders a hole."""
    if approve not in APPROVE_MODES:
        raise ValueError(f"--approve must be one of {', '.join(APPROVE_MODES)}, not {approve!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if not methods:
        raise ValueError("at least one quantization method is needed")
    if suites is not None and not suites:
        raise ValueError("--suites is empty")
    return {"methods": list(methods), "policy": policy, "approve": approve, "limit": limit,
            "suites": list(suites) if suites else None, **extra}


@dataclass
class Notified:
    event_id: str
    model: str
    flow_run_id: str | None  # the run the trigger created, when one was seen in time
    flow_run_name: str | None
    deployment: str | None  # None: no deployment registered, nothing will run


def emit_model_changed(model: str, payload: dict) -> str:
    event = emit_event(EVENT_NAME, resource={"prefect.resource.id": model, "prefect.resource.name": model}, payload=payload)
    if event is None:
        raise RuntimeError("Prefect did not emit the event (are events disabled in the Prefect settings?)")
    return str(event.id)


def deployment_id(name: str = DEPLOYMENT_NAME):
    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(f"{FLOW_NAME}/{name}").id
        except ObjectNotFound:
            return None


def triggered_run(dep_id, model: str, since: float):
    """The newest run of the deployment for `model` created after `since` (epoch seconds), if any."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep_id])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=20,
        )
    for run in runs:
        if run.created is not None and run.created.timestamp() >= since - 1 and run.parameters.get("model") == model:
            return run
    return None


def notify(model: str, payload: dict, wait_s: float = 90.0, deployment: str = DEPLOYMENT_NAME) -> Notified:
    """Emit `quantgate.model.changed` for `model` and wait (up to `wait_s`) for the run it triggers."""
    dep_id = deployment_id(deployment)
    since = time.time()
    event_id = emit_model_changed(model, payload)
    if dep_id is None:
        return Notified(event_id, model, None, None, None)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        run = triggered_run(dep_id, model, since)
        if run is not None:
            return Notified(event_id, model, str(run.id), run.name, f"{FLOW_NAME}/{deployment}")
        time.sleep(1.0)
    return Notified(event_id, model, None, None, f"{FLOW_NAME}/{deployment}")
