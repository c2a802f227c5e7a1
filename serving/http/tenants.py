"""Tenants: API key -> tenant, and each tenant's KV-block quota and waiting-queue limit.

The `--api-keys` file (YAML):

    keys:                       # API key -> tenant
      sk-team-a-1: team-a
      sk-team-b-1: team-b
    tenants:                    # optional limits per tenant
      team-a: {max_kv_blocks: 0.5, max_waiting: 16}   # a float in (0, 1]: a share of the KV cache
      team-b: {max_kv_blocks: 200}                     # an int: a number of blocks
    metrics_key: sk-metrics-0123456789  # optional: the bearer key /metrics asks for (or --metrics-key)

A tenant without limits may use the whole cache and queue up to the server's `--max-waiting`. With
tenants configured, /metrics (which has per-tenant series) answers only to the metrics key, never to
a tenant's key. How the scheduler shares the engine between tenants is serving/core/fairness.py, which this
file's parsing never reaches.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from quantgate.config import StrictModel, validate_config
from quantgate.files import read_yaml
from serving.core.fairness import kv_block_quota

__all__ = ["DEFAULT_TENANT", "KeysFile", "Tenant", "TenantTable", "key_matches", "load_tenants", "parse_tenants"]

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    max_kv_blocks: int | float | None = None  # int: blocks; float in (0, 1]: share of the cache
    max_waiting: int | None = None

    def kv_block_quota(self, num_blocks: int) -> int | None:
        return kv_block_quota(self.max_kv_blocks, num_blocks)


@dataclass(frozen=True)
class TenantTable:
    tenants: dict[str, Tenant]
    keys: dict[str, str]  # API key -> tenant name
    metrics_key: str | None = None

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant owning `key`, compared in constant time; None for a missing or unknown key."""
        if not key:
            return None
        found = None
        for known, tenant in self.keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return self.tenants[found] if found else None

    def with_metrics_key(self, key: str | None) -> TenantTable:
        """This table with `key` (e.g. from --metrics-key) as its metrics key, checked as the file's is."""
        if key is None:
            return self
        _check_metrics_key(key, self.keys, "--metrics-key")
        return TenantTable(self.tenants, self.keys, key)

    def quotas(self, num_blocks: int) -> dict[str, int]:
        return {
            name: quota for name, t in self.tenants.items() if (quota := t.kv_block_quota(num_blocks)) is not None
        }


def load_tenants(path: str | Path) -> TenantTable:
    """Read and check an API-keys file; ValueError names the first problem."""
    data = read_yaml(path, "API-keys file")
    return parse_tenants(data, source=str(path))


def _keys(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not value:
        raise ValueError("`keys` must be a non-empty mapping of API key -> tenant name")
    for key, tenant in value.items():
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError(f"API key {str(key)[:4]!r}... must be a string of at least 8 characters")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"the tenant of key {key[:4]!r}... must be a non-empty string")
    return value


def _kv_blocks(blocks: Any) -> int | float | None:
    if blocks is None:
        return None
    if isinstance(blocks, bool) or not isinstance(blocks, int | float):
        raise ValueError(f"must be a number, got {blocks!r}")
    if isinstance(blocks, float) and not 0 < blocks <= 1:
        raise ValueError(f"a float is a share of the cache and must be in (0, 1], got {blocks}")
    if isinstance(blocks, int) and blocks < 1:
        raise ValueError(f"must be >= 1, got {blocks}")
    return blocks


def _max_waiting(waiting: Any) -> int | None:
    if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, int) or waiting < 0):
        raise ValueError(f"must be an integer >= 0, got {waiting!r}")
    return waiting


_empty_if_null = BeforeValidator(lambda value: {} if value is None else value)


class _Limits(StrictModel):
    max_kv_blocks: Annotated[int | float | None, BeforeValidator(_kv_blocks)] = None
    max_waiting: Annotated[int | None, BeforeValidator(_max_waiting)] = None


class KeysFile(StrictModel):
    """The API-keys file's schema (see the module's docstring)."""

    keys: Annotated[dict[str, str], BeforeValidator(_keys)] = Field(None, validate_default=True)
    tenants: Annotated[dict[str, Annotated[_Limits, _empty_if_null]], _empty_if_null] = {}
    metrics_key: Any = None

    @model_validator(mode="after")
    def _consistent(self) -> KeysFile:
        undefined = set(self.tenants) - set(self.keys.values())
        if undefined:
            raise ValueError(f"tenant(s) {sorted(undefined)} have limits but no API key")
        if self.metrics_key is not None:
            _check_metrics_key(self.metrics_key, self.keys, "`metrics_key`")
        return self


def parse_tenants(data: object, source: str = "API-keys file") -> TenantTable:
    f = validate_config(KeysFile, data, source)
    tenants = {}
    for name in sorted(set(f.keys.values())):
        limits = f.tenants.get(name) or _Limits()
        tenants[name] = Tenant(name, limits.max_kv_blocks, limits.max_waiting)
    return TenantTable(tenants, dict(f.keys), f.metrics_key)


def key_matches(expected: str | None, presented: str | None) -> bool:
    """Constant-time comparison of a presented bearer key with the expected one (none expected: no match)."""
    return bool(expected and presented) and hmac.compare_digest(expected.encode(), presented.encode())


def _check_metrics_key(key: object, api_keys: dict[str, str], what: str) -> None:
    if not isinstance(key, str) or len(key) < 8:
        raise ValueError(f"{what} must be a string of at least 8 characters")
    if key in api_keys:
        raise ValueError(f"{what} must differ from every tenant's API key: a tenant must not read other "
                         "tenants' metrics")
