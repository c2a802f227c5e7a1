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
a tenant's key.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from pathlib import Path

from quantgate.files import read_yaml

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    max_kv_blocks: int | float | None = None  # int: blocks; float in (0, 1]: share of the cache
    max_waiting: int | None = None

    def kv_block_quota(self, num_blocks: int) -> int | None:
        if self.max_kv_blocks is None:
            return None
        if isinstance(self.max_kv_blocks, float):
            return max(1, math.floor(self.max_kv_blocks * num_blocks))
        return min(self.max_kv_blocks, num_blocks)


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


def parse_tenants(data: object, source: str = "API-keys file") -> TenantTable:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with `keys` (and optionally `tenants`)")
    unknown = set(data) - {"keys", "tenants", "metrics_key"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level field(s) {sorted(unknown)}; "
                         "expected `keys`, `tenants`, `metrics_key`")
    keys = data.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise ValueError(f"{source}: `keys` must be a non-empty mapping of API key -> tenant name")
    for key, tenant in keys.items():
        if not isinstance(key, str) or len(key) < 8:
            raise ValueError(f"{source}: API key {str(key)[:4]!r}... must be a string of at least 8 characters")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{source}: the tenant of key {key[:4]!r}... must be a non-empty string")
    limits = data.get("tenants") or {}
    if not isinstance(limits, dict):
        raise ValueError(f"{source}: `tenants` must be a mapping of tenant name -> limits")
    undefined = set(limits) - set(keys.values())
    if undefined:
        raise ValueError(f"{source}: tenant(s) {sorted(undefined)} have limits but no API key")
    tenants = {name: _tenant(name, limits.get(name) or {}, source) for name in sorted(set(keys.values()))}
    metrics_key = data.get("metrics_key")
    if metrics_key is not None:
        _check_metrics_key(metrics_key, keys, f"{source}: `metrics_key`")
    return TenantTable(tenants, dict(keys), metrics_key)


def key_matches(expected: str | None, presented: str | None) -> bool:
    """Constant-time comparison of a presented bearer key with the expected one (none expected: no match)."""
    return bool(expected and presented) and hmac.compare_digest(expected.encode(), presented.encode())


def _check_metrics_key(key: object, api_keys: dict[str, str], what: str) -> None:
    if not isinstance(key, str) or len(key) < 8:
        raise ValueError(f"{what} must be a string of at least 8 characters")
    if key in api_keys:
        raise ValueError(f"{what} must differ from every tenant's API key: a tenant must not read other "
                         "tenants' metrics")


def _tenant(name: str, spec: object, source: str) -> Tenant:
    if not isinstance(spec, dict):
        raise ValueError(f"{source}: limits of tenant {name!r} must be a mapping")
    unknown = set(spec) - {"max_kv_blocks", "max_waiting"}
    if unknown:
        raise ValueError(f"{source}: tenant {name!r} has unknown field(s) {sorted(unknown)}; "
                         "expected max_kv_blocks, max_waiting")
    blocks = spec.get("max_kv_blocks")
    if blocks is not None:
        if isinstance(blocks, bool) or not isinstance(blocks, int | float):
            raise ValueError(f"{source}: tenant {name!r}: max_kv_blocks must be a number, got {blocks!r}")
        if isinstance(blocks, float) and not 0 < blocks <= 1:
            raise ValueError(f"{source}: tenant {name!r}: a float max_kv_blocks is a share of the cache "
                             f"and must be in (0, 1], got {blocks}")
        if isinstance(blocks, int) and blocks < 1:
            raise ValueError(f"{source}: tenant {name!r}: max_kv_blocks must be >= 1, got {blocks}")
    waiting = spec.get("max_waiting")
    if waiting is not None and (isinstance(waiting, bool) or not isinstance(waiting, int) or waiting < 0):
        raise ValueError(f"{source}: tenant {name!r}: max_waiting must be an integer >= 0, got {waiting!r}")
    return Tenant(name, blocks, waiting)
