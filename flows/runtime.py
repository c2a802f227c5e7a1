"""Where Prefect keeps its state for quantgate, decided before Prefect is imported.

Nothing here runs at import: `prepare()` changes `os.environ`, so only a process's edge calls it, before it
imports Prefect (whose settings are read once, when `prefect` is imported): the CLI verbs (flows/cli.py,
flows/tune_cli.py), `release_flow` at its start (the deployment's flow-run process), and the tests' conftest.
A work pool's flow-run process imports Prefect and flows.release (torch, transformers) before the flow body
runs, so the deployment also carries `deployment_env()` in its job variables: set when that process starts.

No `PREFECT_API_URL`: each process talks to a temporary local API over the sqlite database under
`PREFECT_HOME` (shared by all processes, so `quantgate approve` in one terminal resumes a release paused
in another). With `PREFECT_API_URL` set (e.g. `prefect server start` on loopback) everything goes there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantgate.env import OFFLINE_QUIET_DEFAULTS, apply_defaults, home

PREFECT_DEFAULTS: dict[str, str] = {
    # The temporary API can take longer than Prefect's default (20 s) to start on a small busy machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
}


def prepare() -> Path:
    """Offline/quiet defaults plus Prefect's home and result storage under quantgate's home.

    It sets environment variables (not settings objects) because Prefect, MLflow and the Hugging Face libraries
    read them, and because the processes Prefect starts (its temporary API, flow runs) inherit them. Idempotent:
    what the user set wins."""
    apply_defaults()
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    storage = results_dir()
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(storage))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    return storage


def deployment_env() -> dict[str, str]:
    """What a work pool's flow-run process needs set before it starts: the offline/quiet and Prefect
    defaults that do not depend on the machine (paths under quantgate's home are the worker's own, set by
    `prepare()` in the flow). They override the worker's environment for that run; change them in the
    deployment's job variables."""
    return {**OFFLINE_QUIET_DEFAULTS, **PREFECT_DEFAULTS}


def results_dir() -> Path:
    """Persisted task results and cache records: what a rerun after a crash resumes from."""
    path = home() / "flows" / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def work_dir(*parts: str) -> Path:
    """Files a release writes (eval samples, benchmark JSON, canary traces), kept beside the cache."""
    path = home().joinpath("flows", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class SharedApi:
    url: str
    server_pid: int | None  # the temporary API server started here, if one was


@contextmanager
def shared_api() -> Iterator[SharedApi]:
    """The Prefect API of this process and of the flow-run processes it starts.

    `PREFECT_API_URL` when set. Otherwise one temporary local API (over the sqlite under PREFECT_HOME)
    started here and handed to the children, so no flow run pays for starting and stopping one of its
    own. It runs in its own session: a Ctrl-C sent to our process group must not take it down while the
    runs in flight are being recorded; it dies with this process and is stopped on exit.
    """
    url = os.environ.get("PREFECT_API_URL", "").strip()
    if url:
        yield SharedApi(url, None)
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = _own_session_server()
    try:
        server.start()  # inside: a Ctrl-C while it starts stops it too
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            yield SharedApi(server.api_url, server.server_process.pid)
    finally:
        _flush_logs()
        _stop_server(server)


def _flush_logs() -> None:
    """Run logs still queued for the API go out before it stops (else errors at exit, and they are lost)."""
    from prefect.logging.handlers import APILogHandler

    try:
        APILogHandler.flush()
    except Exception:  # the API may be gone already; nothing more to do for those logs
        pass


def _own_session_server():
    import subprocess

    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class OwnSessionServer(SubprocessASGIServer):
        """Prefect's temporary API server (the same command and environment), in a session of its own."""

        def _run_uvicorn_command(self) -> subprocess.Popen:
            command = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
                       "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                       "--port", str(self.port), "--log-level", "error", "--lifespan", "on"]
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
            return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent())

    return OwnSessionServer(port=None)


def _die_with_parent() -> Callable[[], None] | None:
    """For the child before exec: SIGTERM when the parent dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG).

    libc is looked up here, in the parent: the child then only makes the call.
    """
    import ctypes
    import signal

    prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None
    if prctl is None:
        return None
    return lambda: prctl(1, int(signal.SIGTERM))


def _stop_server(server, wait_s: float = 2.0) -> None:
    """Prefect's stop waits 5 s for a server that lingers on open connections; ours waits less."""
    import subprocess

    process = getattr(server, "server_process", None)
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
    server.stop()
