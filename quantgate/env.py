"""The one place where quantgate's offline, quiet defaults and its data directory are decided.

Every entry point (CLI, tests, benchmarks) calls `apply_defaults()` before importing transformers,
MLflow, Prefect or datasets, so that none of them reaches for a hub or a telemetry host.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from quantgate import settings

OFFLINE_QUIET_DEFAULTS: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "GIT_PYTHON_REFRESH": "quiet",
}


def home() -> Path:
    """Long-lived state (converted models, variants, MLflow store, Prefect home) lives here."""
    path = settings.home()
    path.mkdir(parents=True, exist_ok=True)
    return path


def apply_defaults() -> None:
    """Set the offline/quiet variables unless the user set them; idempotent."""
    for key, value in OFFLINE_QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("PREFECT_HOME", str(home() / "prefect"))
    warnings.filterwarnings("ignore", message=".*kernels.*")
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt: inputs will be cast.*")
