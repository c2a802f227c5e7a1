"""The Ray cluster a release spreads its per-model work over (`quantgate release --ray-address ADDR`).

The release's flow process is the Ray driver: it connects (`connect`), looks at every node before anything is
built, and refuses the cluster (`ClusterRefused`, naming the node) when a node

- does not see the driver's `QUANTGATE_HOME`: the driver writes a marker file under its home, a task pinned to
  each node (hard node affinity) reads it under that node's home. Variants, eval results and Prefect's persisted
  results are files under the home whose absolute paths travel between nodes, so the home must be the same path
  on the same (shared) storage everywhere;
- would serve at other numerics than the driver (device, dtype, kernel path, kernel sources, quantgate version,
  `flows.machine.describe`): the baseline measured on one node and a variant on another would be compared
  across numerics, and the per-item outputs would not be a one-process release's;
- or when no node has the CPUs or the memory (Ray's `memory` resource) one stage's task asks for: Ray would
  queue that task forever.

The per-model work then runs as Prefect tasks submitted to prefect-ray's `RayTaskRunner` (flows/release_on_ray.py),
each with `task_options`: the CPUs it reserves (torch gets that many threads), the memory its stage peaks at
(flows/memory_plan.py, so a node never takes more models than fit) and Ray's own retries when a worker dies.
The paired speed rounds and the canary never leave the driver's process: `Cluster.driver` names that node.

Importing this module imports neither Ray nor torch; nothing here sets `os.environ` (the workers' environment
comes from Ray's runtime_env: `runtime.deployment_env()`, the same defaults a work pool's flow run gets).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from quantgate import settings

NAMESPACE = "quantgate"
MARKER_DIR = "ray"  # under QUANTGATE_HOME: the driver's marker files, removed after the check
# What must be equal on every node for a model's per-item outputs not to depend on where it ran (machine.describe)
NUMERICS = ("device", "dtype", "isa", "kernel_sources", "quantgate")
WORKER_RETRIES = 2  # Ray resubmits a task whose worker process or node died, this many times
CHECK_TIMEOUT_S = 180.0  # a node's look (a fresh worker importing torch) must answer within this

TAG_ADDRESS = "quantgate.ray.address"
TAG_NODES = "quantgate.ray.nodes"
TAG_DRIVER = "quantgate.ray.speed_node"
TAG_TASK_CPUS = "quantgate.ray.task_cpus"  # CPUs each task reserves = torch threads: fp32 sums depend on them


class ClusterRefused(ValueError):
    """The cluster cannot run this release as one process would (a ValueError: bad input, never retried)."""


@dataclass(frozen=True)
class NodeView:
    """What one node reported about itself (`look`)."""

    node_id: str
    ip: str
    host: str
    home: str
    marker: bool  # it read the driver's marker under its own home
    machine: dict = field(default_factory=dict)
    cpus: float = 0.0
    memory: float = 0.0  # Ray's `memory` resource of the node, bytes

    def name(self) -> str:
        return f"{self.host} ({self.ip}, Ray node {self.node_id[:12]})"


@dataclass(frozen=True)
class Cluster:
    """A checked cluster: its address, its nodes, where the speed rounds and canary run, the CPUs a task takes."""

    address: str
    driver: str  # the driver's node in words: the paired speed rounds and the canary run in its process
    nodes: tuple[NodeView, ...]
    task_cpus: int

    def tags(self) -> dict[str, str]:
        """What the release run records in MLflow."""
        nodes = "; ".join(f"{n.name()}: {n.cpus:g} CPUs, {n.memory / 2**30:.1f} GiB" for n in self.nodes)
        return {TAG_ADDRESS: self.address, TAG_NODES: nodes[:5000], TAG_DRIVER: self.driver,
                TAG_TASK_CPUS: str(self.task_cpus)}


# ---- on each node -----------------------------------------------------------------------------------


def look(marker_name: str, device: str) -> dict:
    """Run on one node (a Ray task pinned to it): its id, address, home, whether it reads the driver's marker
    there, and the numerics it would serve at."""
    import ray

    from flows.machine import describe

    home = settings.home()
    marker = home / MARKER_DIR / marker_name
    try:
        seen = marker.read_text() == marker_name
    except OSError:
        seen = False
    try:
        machine = describe(device)
    except ValueError as exc:  # e.g. a CUDA release on a node without a GPU
        machine = {"device": f"refused: {exc}"}
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(), "home": str(home.resolve()), "marker": seen,
            "machine": {k: machine.get(k) for k in (*NUMERICS, "threads", "cpu_model")}}


# ---- on the driver ----------------------------------------------------------------------------------


def connect(address: str, device: str, stage_bytes: dict[str, int] | None = None,
            task_cpus: int | None = None) -> Cluster:
    """Connect this process (the driver) to the cluster at `address` and check it (`check`); on a refusal the
    connection is closed again. `stage_bytes`: each Ray stage's planned peak (its task's `memory`)."""
    try:
        import prefect_ray  # noqa: F401 - the task runner the release submits to
        import ray
    except ImportError as exc:
        raise ClusterRefused(f"--ray-address needs Ray and prefect-ray: pip install -e '.[fleet]' ({exc})") from None

    from flows.runtime import deployment_env

    ray.init(address=address, namespace=NAMESPACE, ignore_reinit_error=True, log_to_driver=False,
             runtime_env={"env_vars": deployment_env()})
    try:
        return check(address, device, stage_bytes or {}, task_cpus)
    except BaseException:
        ray.shutdown()
        raise


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]


def driver_node() -> str:
    """The node this process runs on, in words."""
    import ray

    host = socket.gethostname()
    try:
        node_id = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - a Ray Client driver has no node of its own
        return f"{host} (the flow's process, outside the cluster)"
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n.get("NodeID") == node_id), "?")
    return f"{host} ({ip}, Ray node {node_id[:12]}; the flow's process)"


def check(address: str, device: str, stage_bytes: dict[str, int], task_cpus: int | None = None) -> Cluster:
    """Every alive node with CPUs looks at itself; refuses (ClusterRefused) what would not give one process's
    results. `task_cpus` None: the smallest node's CPUs (one engine per node at a time, all its cores)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from flows.machine import describe

    nodes = alive_nodes()
    if not nodes:
        raise ClusterRefused(f"the Ray cluster at {address} has no alive node with CPUs")
    home = settings.home().resolve()
    marker_name = f"check-{uuid.uuid4().hex}"
    marker = home / MARKER_DIR / marker_name
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(marker_name)
    try:
        refs = {n["NodeID"]: ray.remote(look).options(
                    num_cpus=0, max_retries=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                    marker_name, device) for n in nodes}
        views = _gather(refs, nodes)
    finally:
        marker.unlink(missing_ok=True)
    mine = describe(device)
    problems = []
    for v in views:
        if v.home != str(home):
            problems.append(f"{v.name()} sees QUANTGATE_HOME={v.home}, not the driver's {home}")
        elif not v.marker:
            problems.append(f"{v.name()} has {v.home}, but not the driver's: the marker {marker} the driver wrote "
                            "is not there (another disk at the same path)")
        differ = [f"{k} {v.machine.get(k)!r} (driver: {mine.get(k)!r})" for k in NUMERICS if v.machine.get(k) != mine.get(k)]
        if differ:
            problems.append(f"{v.name()} would serve at other numerics: {', '.join(differ)}")
    if problems:
        raise ClusterRefused(
            f"the Ray cluster at {address} cannot run this release as one process would: " + "; ".join(problems)
            + ". Every node needs the same QUANTGATE_HOME on shared storage (variants, eval results and Prefect's "
            "results are files there) and the driver's serving numerics (docs/team.md, 'A release on a Ray cluster').")
    cpus = task_cpus or max(1, int(min(v.cpus for v in views)))
    too_big = [f"{name} needs {b / 2**30:.2f} GiB" for name, b in stage_bytes.items()
               if not any(v.memory >= b and v.cpus >= cpus for v in views)]
    if too_big:
        raise ClusterRefused(f"no node of the Ray cluster at {address} has the memory (and {cpus} CPUs) for: "
                             f"{'; '.join(too_big)} (nodes: "
                             + "; ".join(f"{v.name()} {v.cpus:g} CPUs, {v.memory / 2**30:.2f} GiB" for v in views) + ")")
    return Cluster(address=address, driver=driver_node(), nodes=tuple(views), task_cpus=cpus)


def _gather(refs: dict, nodes: list[dict]) -> list[NodeView]:
    import ray

    by_id = {n["NodeID"]: n for n in nodes}
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=CHECK_TIMEOUT_S)
    if pending:
        silent = [f"{by_id[i]['NodeManagerAddress']} (Ray node {i[:12]})" for i, r in refs.items() if r in pending]
        raise ClusterRefused(f"Ray nodes did not answer the home check within {CHECK_TIMEOUT_S:.0f} s: "
                             f"{', '.join(silent)}")
    views = []
    for node_id, ref in refs.items():
        try:
            seen = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a node that cannot run the look is named, not skipped
            raise ClusterRefused(f"Ray node {node_id[:12]} ({by_id[node_id]['NodeManagerAddress']}) failed the "
                                 f"home check: {exc}") from exc
        res = by_id[node_id].get("Resources", {})
        views.append(NodeView(node_id=seen["node_id"], ip=seen["ip"], host=seen["host"], home=seen["home"],
                              marker=seen["marker"], machine=seen["machine"], cpus=float(res.get("CPU", 0)),
                              memory=float(res.get("memory", 0))))
    return views


@contextmanager
def task_options(cluster: Cluster, memory_bytes: int | None = None) -> Iterator[None]:
    """What each task submitted inside asks Ray for: the cluster's CPUs per task, the stage's planned memory,
    Ray's retries when its worker dies (a task's own exceptions are Prefect's to retry: never Ray's)."""
    from prefect_ray.context import remote_options

    options: dict = {"num_cpus": cluster.task_cpus, "max_retries": WORKER_RETRIES, "retry_exceptions": False}
    if memory_bytes:
        options["memory"] = int(memory_bytes)
    with remote_options(**options):
        yield


def task_runner(cluster: Cluster):
    """prefect-ray's task runner on the connected cluster: it finds this process connected and uses that
    connection (prefect-ray 0.6 then leaves it open: the release closes it, `disconnect`)."""
    from prefect_ray import RayTaskRunner

    return RayTaskRunner(address=cluster.address,
                         init_kwargs={"namespace": NAMESPACE, "ignore_reinit_error": True, "log_to_driver": False})


def use_task_cpus() -> int | None:
    """In a Ray worker: torch takes as many threads as the task reserved CPUs (a reused worker keeps the thread
    count of whatever ran in it first); elsewhere nothing. Returns the count set."""
    try:
        import ray

        if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
            return None
        cpus = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0))
    except Exception:  # noqa: BLE001 - not in a worker
        return None
    if cpus >= 1:
        import torch

        torch.set_num_threads(cpus)
        return cpus
    return None


def marker_dir() -> Path:
    return settings.home() / MARKER_DIR
