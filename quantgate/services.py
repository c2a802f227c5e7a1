"""`quantgate services up|down|status`: PostgreSQL, a Prefect server and an MLflow tracking server on
loopback, for a team's release pipeline instead of the embedded per-process defaults.

- PostgreSQL (`quantgate.postgres`): cluster under `QUANTGATE_HOME/services/pg`, databases `prefect`
  and `mlflow`.
- `prefect server start` with `PREFECT_API_DATABASE_CONNECTION_URL` on the `prefect` database, UI on.
- `mlflow server --backend-store-uri postgresql://.../mlflow --serve-artifacts` with the artifacts under
  `QUANTGATE_HOME/services/mlflow-artifacts`: clients upload over HTTP, never by path.

The two servers run in sessions of their own (a Ctrl-C in the terminal that started them does not stop
them); `down` stops each whole process group, then PostgreSQL. What runs where is in `services/state.json`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from quantgate.env import apply_defaults, home
from quantgate.postgres import Postgres, find_bindir


class ServicesConfig(BaseModel):
    host: str = "127.0.0.1"
    pg_port: int = Field(55432, ge=1, le=65535)
    prefect_port: int = Field(4200, ge=1, le=65535)
    mlflow_port: int = Field(5000, ge=1, le=65535)
    mlflow_workers: int = Field(2, ge=1)
    start_timeout_s: float = Field(180.0, gt=0)


@dataclass
class ServiceState:
    name: str
    pid: int
    url: str
    log: str


@dataclass
class Services:
    root: str
    host: str
    pg_port: int
    prefect_url: str
    mlflow_url: str
    processes: list[ServiceState] = field(default_factory=list)
    started_at: float = 0.0

    def env(self) -> dict[str, str]:
        """What a client (CLI, worker, test) exports to use these services."""
        return {"PREFECT_API_URL": f"{self.prefect_url}/api", "MLFLOW_TRACKING_URI": self.mlflow_url}

    def env_lines(self) -> str:
        return "\n".join(f"export {k}={v}" for k, v in self.env().items())


def services_dir() -> Path:
    path = home() / "services"
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_file() -> Path:
    return services_dir() / "state.json"


def read_state() -> Services | None:
    try:
        data = json.loads(state_file().read_text())
    except FileNotFoundError:
        return None
    data["processes"] = [ServiceState(**p) for p in data.get("processes", [])]
    return Services(**data)


def _write_state(services: Services) -> None:
    tmp = state_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(services), indent=2))
    tmp.replace(state_file())


def postgres(config: ServicesConfig) -> Postgres:
    return Postgres(services_dir() / "pg", config.pg_port, config.host)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return True


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - loopback, our own URL
            return response.status == 200
    except OSError:
        return False


def _spawn(name: str, argv: list[str], env: dict[str, str]) -> ServiceState:
    log = services_dir() / f"{name}.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, cwd=services_dir())
    return ServiceState(name, process.pid, "", str(log))


def _server_env() -> dict[str, str]:
    apply_defaults()
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def start_prefect(config: ServicesConfig, pg: Postgres) -> ServiceState:
    env = _server_env()
    for key in ("PREFECT_API_URL", "PREFECT_SERVER_API_HOST", "PREFECT_SERVER_API_PORT"):
        env.pop(key, None)
    env.update({
        "PREFECT_API_DATABASE_CONNECTION_URL": pg.url("prefect", driver="asyncpg"),
        "PREFECT_HOME": str(services_dir() / "prefect-server"),
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_SERVER_UI_ENABLED": "true",
        "PREFECT_UI_API_URL": f"http://{config.host}:{config.prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
    })
    argv = [sys.executable, "-m", "prefect", "server", "start", "--host", config.host, "--port", str(config.prefect_port), "--ui"]
    state = _spawn("prefect", argv, env)
    state.url = f"http://{config.host}:{config.prefect_port}"
    return state


def start_mlflow(config: ServicesConfig, pg: Postgres) -> ServiceState:
    artifacts = services_dir() / "mlflow-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    env = _server_env()
    env.pop("MLFLOW_TRACKING_URI", None)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no GenAI job-runner processes
    env["MLFLOW_BACKEND_STORE_URI"] = pg.url("mlflow")  # = --backend-store-uri, without the password in `ps`
    argv = [sys.executable, "-m", "mlflow", "server",
            "--serve-artifacts", "--artifacts-destination", str(artifacts.resolve()),
            "--host", config.host, "--port", str(config.mlflow_port), "--workers", str(config.mlflow_workers)]
    state = _spawn("mlflow", argv, env)
    state.url = f"http://{config.host}:{config.mlflow_port}"
    return state


HEALTH = {"prefect": "/api/health", "mlflow": "/health"}


def _wait_healthy(states: list[ServiceState], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(states)
    while waiting:
        for s in list(waiting):
            if not alive(s.pid):
                tail = Path(s.log).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the {s.name} server exited while starting; the end of {s.log}:\n{tail}")
            if healthy(s.url + HEALTH[s.name]):
                waiting.remove(s)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            raise RuntimeError(f"{names} not healthy after {timeout_s:.0f} s (logs: {', '.join(s.log for s in waiting)})")
        time.sleep(0.5)


def up(config: ServicesConfig | None = None) -> Services:
    """Start whatever of the three is not running; returns where they are."""
    config = config or ServicesConfig()
    current = read_state()
    if current is not None and all(alive(p.pid) for p in current.processes) and status(current)["all_healthy"]:
        return current
    if current is not None:
        down()
    if find_bindir() is None:
        raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql (Debian), then rerun")
    pg = postgres(config)
    pg.init(home())
    if pg.pid() is None or not pg.running():
        pg.start()
    else:
        pg.create_databases()
    started = [start_prefect(config, pg), start_mlflow(config, pg)]
    services = Services(root=str(services_dir()), host=config.host, pg_port=config.pg_port,
                        prefect_url=started[0].url, mlflow_url=started[1].url,
                        processes=[ServiceState("postgres", pg.pid() or 0, f"{config.host}:{config.pg_port}",
                                                str(pg.log_file)), *started], started_at=time.time())
    _write_state(services)  # before waiting: a failed start is still stopped by `down`
    try:
        _wait_healthy(started, config.start_timeout_s)
    except BaseException:
        down()
        raise
    return services


def _stop_group(pid: int, timeout_s: float) -> None:
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def down(timeout_s: float = 20.0) -> list[str]:
    """Stop the two servers (their whole process groups) and PostgreSQL; returns what was stopped."""
    current = read_state()
    stopped = []
    for p in (current.processes if current else []):
        if p.name != "postgres" and alive(p.pid):
            _stop_group(p.pid, timeout_s)
            stopped.append(p.name)
    pg = Postgres(services_dir() / "pg", current.pg_port if current else ServicesConfig().pg_port)
    if pg.pid() is not None and alive(pg.pid()):
        pg.stop()
        stopped.append("postgres")
    state_file().unlink(missing_ok=True)
    return stopped


def status(services: Services | None = None) -> dict:
    services = services or read_state()
    if services is None:
        return {"running": False, "all_healthy": False, "services": {}}
    rows = {}
    for p in services.processes:
        up_now = alive(p.pid)
        ok = up_now if p.name == "postgres" else up_now and healthy(p.url + HEALTH[p.name])
        rows[p.name] = {"pid": p.pid, "url": p.url, "alive": up_now, "healthy": ok, "log": p.log}
    return {"running": True, "all_healthy": all(r["healthy"] for r in rows.values()), "services": rows}
