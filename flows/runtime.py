"""Where Prefect keeps its state for quantgate, decided before Prefect is imported.

No `PREFECT_API_URL`: each process talks to a temporary local API over the sqlite database under
`PREFECT_HOME` (shared by all processes, so `quantgate approve` in one terminal resumes a release paused
in another). With `PREFECT_API_URL` set (e.g. `prefect server start` on loopback) everything goes there.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantgate.env import apply_defaults, home

PREFECT_DEFAULTS: dict[str, str] = {
    # The temporary API needs 10-25 s to start on 2 busy cores; Prefect's default (20 s) is too tight.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
}


def prepare() -> Path:
    """Offline/quiet defaults plus Prefect's home and result storage under quantgate's home."""
    apply_defaults()
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    storage = results_dir()
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(storage))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    return storage


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


def api_mode() -> str:
    url = os.environ.get("PREFECT_API_URL", "").strip()
    return url or "temporary local API (sqlite under PREFECT_HOME)"
