"""fleet.yaml: the fleet's versions, their replicas, autoscaling and routing, as pydantic models."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Autoscaling(_Strict):
    """Ray Serve's autoscaling for one version. `min_replicas` is the warm pool."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(3.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    look_back_period_s: float = Field(5.0, gt=0)
    # predictive: a schedule file of (seconds into the day, replicas) rows, scaled out `lead_s` ahead
    schedule: str | None = None
    lead_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class VersionSpec(_Strict):
    """One served version: a model reference (alias, HF dir or variant dir) and its engine settings."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    model: str
    weight: float = Field(0.0, ge=0)
    num_replicas: int = Field(1, ge=1, description="fixed replica count when `autoscaling` is not given")
    autoscaling: Autoscaling | None = None
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    kv_cache_dtype: Literal["auto", "int8", "fp8"] = "auto"
    max_num_seqs: int = Field(64, ge=1)
    max_waiting: int = Field(256, ge=1)
    max_ongoing_requests: int = Field(64, ge=1)
    dtype: str = "auto"
    device: str | None = None
    threads: int | None = Field(None, ge=1)
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs each replica reserves")


class FleetConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="the Ray Serve application name")
    served_model_name: str | None = None
    route_prefix: str = "/"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    router: Literal["kv", "pow2"] = "kv"
    routing_stats_period_s: float = Field(0.5, gt=0)
    versions: list[VersionSpec] = Field(min_length=1)
    champion: str | None = None
    # /fleet/state and /fleet/traffic ask for `Authorization: Bearer <admin key>` when one is set
    admin_key: str | None = Field(None, min_length=8)
    admin_key_env: str | None = None

    @model_validator(mode="after")
    def _versions(self) -> FleetConfig:
        names = [v.name for v in self.versions]
        if len(set(names)) != len(names):
            raise ValueError(f"version names must be unique, got {names}")
        if self.champion is None:
            self.champion = names[0]
        if self.champion not in names:
            raise ValueError(f"champion {self.champion!r} is not one of the versions {names}")
        if not any(v.weight > 0 for v in self.versions):  # nothing weighted: all traffic to the champion
            for v in self.versions:
                v.weight = 1.0 if v.name == self.champion else 0.0
        return self

    def version(self, name: str) -> VersionSpec:
        for v in self.versions:
            if v.name == name:
                return v
        raise ValueError(f"no version {name!r} in fleet {self.name!r}; versions: {[v.name for v in self.versions]}")

    def resolved_admin_key(self) -> str | None:
        import os

        if self.admin_key:
            return self.admin_key
        if self.admin_key_env:
            key = os.environ.get(self.admin_key_env)
            if not key or len(key) < 8:
                raise ValueError(f"admin_key_env: ${self.admin_key_env} is unset or shorter than 8 characters")
            return key
        return None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.name


def load_fleet_config(path: str | Path) -> FleetConfig:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"fleet config {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    from pydantic import ValidationError

    try:
        return FleetConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{path}: {exc}") from None
