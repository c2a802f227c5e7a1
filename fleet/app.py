"""Build the Ray Serve application for a fleet config, and run, inspect, change and stop it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fleet.coldstart import replica_dir
from fleet.config import Autoscaling, FleetConfig, VersionSpec

KV_ROUTER = "fleet.ray_router:KVAwareRequestRouter"
POW2_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
PREDICTIVE_POLICY = "fleet.autoscale_policy:PredictivePolicy"


def autoscaling_config(a: Autoscaling) -> dict:
    cfg = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
           "target_ongoing_requests": a.target_ongoing_requests, "upscale_delay_s": a.upscale_delay_s,
           "downscale_delay_s": a.downscale_delay_s, "look_back_period_s": a.look_back_period_s}
    if a.initial_replicas is not None:
        cfg["initial_replicas"] = a.initial_replicas
    if a.schedule:
        from fleet.schedule import load_schedule

        kwargs = {**load_schedule(a.schedule).as_kwargs(), "lead_s": a.lead_s,
                  "target_ongoing_requests": a.target_ongoing_requests}
        cfg["policy"] = {"policy_function": PREDICTIVE_POLICY, "policy_kwargs": kwargs}
    return cfg


def deployment_options(config: FleetConfig, v: VersionSpec) -> dict:
    from ray.serve.config import RequestRouterConfig

    opts: dict = {
        "name": v.name, "max_ongoing_requests": v.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": v.num_cpus}, "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0, "graceful_shutdown_timeout_s": 5.0,
        "request_router_config": RequestRouterConfig(
            request_router_class=KV_ROUTER if config.router == "kv" else POW2_ROUTER,
            request_routing_stats_period_s=config.routing_stats_period_s,
            request_routing_stats_timeout_s=max(2.0, 4 * config.routing_stats_period_s)),
    }
    if v.autoscaling is not None:
        opts["autoscaling_config"] = autoscaling_config(v.autoscaling)
    else:
        opts["num_replicas"] = v.num_replicas
    return opts


def build_application(config: FleetConfig):
    """The ingress bound to one deployment per version (what `serve.run` takes)."""
    from ray import serve

    from fleet.ingress import FleetIngress
    from fleet.replica import VersionReplica

    versions = {
        v.name: serve.deployment(VersionReplica).options(**deployment_options(config, v))
        .bind(v.model_dump(), config.model_name)
        for v in config.versions
    }
    return FleetIngress.bind(config.model_dump(), versions)


def resolve_models(config: FleetConfig) -> FleetConfig:
    """Model references as local paths, resolved (and converted, for the GGUF alias) once, here."""
    from quantgate.models import resolve_model

    data = config.model_dump()
    for v in data["versions"]:
        v["model"] = str(resolve_model(v["model"]))
    data["admin_key"] = config.resolved_admin_key()  # read here: replicas on other nodes lack the env
    return FleetConfig.model_validate(data)


# ---- running it ----------------------------------------------------------------------------------
def state_file(name: str) -> Path:
    from quantgate.env import home

    path = home() / "fleet" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report to Ray's servers
    # Serve kills a proxy not ready within 5 s (10 s per health check): on 2 busy cores its worker process
    # can take longer to start, and `serve.start` then fails with ActorDiedError. A local cluster inherits
    # these; a remote one (`address`) keeps its own.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace="quantgate", include_dashboard=False, log_to_driver=False)
    else:
        # "local": a cluster of its own even where another is up on this machine (a bare init attaches to the
        # one /tmp/ray/ray_current_cluster names, and refuses num_cpus there: a Ray test beside it did that)
        ray.init(address="local", num_cpus=num_cpus or 2, namespace="quantgate", include_dashboard=False,
                 log_to_driver=False)


def up(config: FleetConfig, address: str | None = None, num_cpus: int | None = None,
       timeout_s: float = 600.0, record: bool = False) -> dict:
    """Start (or update) the fleet's application; returns where it answers and how long it took."""
    import ray
    from ray import serve

    config = resolve_models(config)
    connect(address, num_cpus)
    serve.start(http_options={"host": config.host, "port": config.port})
    started = time.perf_counter()
    serve.run(build_application(config), name=config.name, route_prefix=config.route_prefix,
              blocking=False)
    _wait_running(config.name, timeout_s)
    info = {"name": config.name, "url": f"http://{config.host}:{config.port}{config.route_prefix.rstrip('/')}",
            "ray_address": ray.get_runtime_context().gcs_address, "pid": os.getpid(),
            "up_s": time.perf_counter() - started, "config": config.model_dump(exclude={"admin_key"})}
    if record:  # for `fleet status|promote|rollback|down` in other processes
        state_file(config.name).write_text(json.dumps({**info, "foreground": address is None}, indent=2) + "\n")
    return info


def _wait_running(name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        status = str(getattr(app, "status", "")).rsplit(".", 1)[-1]
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":
            raise RuntimeError(f"fleet {name} failed to deploy: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"fleet {name} not running after {timeout_s:.0f} s (status {status})")
        time.sleep(0.5)


def stop_file(name: str) -> Path:
    return state_file(name).with_suffix(".stop")


def down(name: str, address: str | None = None, timeout_s: float = 60.0) -> None:
    """A foreground `fleet up` is asked to stop (a file it watches: a second driver would need the local
    cluster's auth token); a fleet on a cluster started with `ray start` is deleted from here."""
    import psutil

    info = saved(name)
    if info.get("foreground") and psutil.pid_exists(int(info["pid"])):
        stop_file(name).touch()
        deadline = time.monotonic() + timeout_s
        while psutil.pid_exists(int(info["pid"])):
            if time.monotonic() > deadline:
                raise TimeoutError(f"`fleet up` (pid {info['pid']}) did not stop within {timeout_s:.0f} s")
            time.sleep(0.5)
    else:
        from ray import serve

        connect(address or info.get("ray_address"))
        serve.delete(name)
    forget(name)


def forget(name: str) -> None:
    import shutil

    state_file(name).unlink(missing_ok=True)
    stop_file(name).unlink(missing_ok=True)
    shutil.rmtree(replica_dir(name).parent, ignore_errors=True)


def saved(name: str) -> dict:
    path = state_file(name)
    if not path.is_file():
        raise ValueError(f"no fleet {name!r} is up (no {path}); start it with `quantgate fleet up`")
    return json.loads(path.read_text())


def status(name: str) -> dict:
    """Ray Serve's view of each deployment plus the live replicas' own reports."""
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None:
        raise ValueError(f"Ray Serve has no application {name!r}")
    out = {"status": str(app.status).rsplit(".", 1)[-1], "deployments": {}}
    for dep_name, dep in app.deployments.items():
        out["deployments"][dep_name] = {"status": str(dep.status).rsplit(".", 1)[-1],
                                        "replica_states": {str(k).rsplit(".", 1)[-1]: v
                                                           for k, v in dep.replica_states.items()}}
    out["replicas"] = live_replicas(name)
    return out


def live_replicas(name: str) -> list[dict]:
    import psutil

    found = []
    for path in sorted(replica_dir(name).glob("*.json")):
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if psutil.pid_exists(int(info.get("pid", -1))):
            found.append(info)
        else:
            path.unlink(missing_ok=True)
    return found
