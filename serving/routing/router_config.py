"""The canary router's config file (YAML), as a pydantic model: a typo in a key is an error naming it.

    model: smollm2-135m          # the name clients ask for (optional; any name if absent)
    admin_key: change-me-please  # or admin_key_env: NAME_OF_ENV_VAR
    canary: int8
    versions:                    # the canary is placed last, so users in it stay in it as it grows
      baseline: {weight: 95, backends: [http://127.0.0.1:8001, http://127.0.0.1:8002]}
      int8:     {weight: 5,  backends: [http://127.0.0.1:8003]}
    poll_interval_s: 0.5         # optional
    timeout_s: 300               # optional: the longest a backend may take to answer
    decisions_log: /path/decisions.jsonl   # optional: promote/rollback records, one JSON per line
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlparse

from pydantic import BeforeValidator, Field, model_validator

from quantgate.config import StrictModel, validate_config
from quantgate.files import read_yaml


@dataclass(frozen=True)
class VersionConfig:
    name: str
    weight: float
    backends: tuple[str, ...]


@dataclass(frozen=True)
class RouterConfig:
    versions: tuple[VersionConfig, ...]
    admin_key: str
    canary: str
    model: str | None = None
    poll_interval_s: float = 0.5
    timeout_s: float = 300.0
    decisions_log: Path | None = None
    host: str = "127.0.0.1"
    port: int = 9000

    @property
    def weights(self) -> dict[str, float]:
        return {v.name: v.weight for v in self.versions}


def load_router_config(path: str | Path) -> RouterConfig:
    data = read_yaml(path, "router config")
    return parse_router_config(data, str(path))


def _positive(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"must be a positive number, got {value!r}")
    return value


def _weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"weight must be a number >= 0, got {value!r}")
    return float(value)


def _backends(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("`backends` must be a non-empty list of URLs")
    for url in value:
        parts = urlparse(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"backend {url!r} is not a base URL like http://127.0.0.1:8001")
    return tuple(str(u).rstrip("/") for u in value)


Positive = Annotated[float, BeforeValidator(_positive)]


class _Version(StrictModel):
    weight: Annotated[float, BeforeValidator(_weight)] = Field(None, validate_default=True)
    backends: Annotated[tuple[str, ...], BeforeValidator(_backends)] = Field(None, validate_default=True)


class RouterFile(StrictModel):
    """The router config file's schema (see the module's docstring)."""

    versions: dict[str, _Version] = Field(min_length=1)
    canary: Any = None
    admin_key: Any = None
    admin_key_env: str | None = None
    model: Any = None
    poll_interval_s: Positive = 0.5
    timeout_s: Positive = 300.0
    decisions_log: Any = None
    host: Any = "127.0.0.1"
    port: Annotated[int, BeforeValidator(_positive)] = 9000

    @model_validator(mode="after")
    def _consistent(self) -> RouterFile:
        if self.canary not in self.versions:
            raise ValueError(f"`canary` must name one of the versions {sorted(self.versions)}, got {self.canary!r}")
        seen: set[str] = set()
        for v in self.versions.values():
            for url in v.backends:
                if url in seen:
                    raise ValueError(f"backend {url} is listed twice")
                seen.add(url)
        if sum(v.weight for v in self.versions.values()) <= 0:
            raise ValueError("at least one version needs a weight > 0")
        return self

    def key(self) -> str:
        key = self.admin_key
        if key is None and self.admin_key_env:
            key = os.environ.get(self.admin_key_env)
            if not key:
                raise ValueError(f"admin_key_env {self.admin_key_env!r} is not set in the environment")
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError("`admin_key` (or `admin_key_env`) must give a key of at least 8 characters")
        return key


def parse_router_config(data: object, source: str = "router config") -> RouterConfig:
    f = validate_config(RouterFile, data, source)
    try:
        key = f.key()
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    versions = sorted((VersionConfig(str(n), v.weight, v.backends) for n, v in f.versions.items()),
                      key=lambda v: v.name == f.canary)  # the canary last (stable otherwise)
    log_path = Path(str(f.decisions_log)).expanduser() if f.decisions_log else None
    return RouterConfig(tuple(versions), key, str(f.canary), str(f.model) if f.model else None,
                        float(f.poll_interval_s), float(f.timeout_s), log_path, str(f.host), int(f.port))
