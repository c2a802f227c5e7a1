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

import bisect
import hmac
import math
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import BeforeValidator, Field, model_validator

from quantgate.config import StrictModel, validate_config
from quantgate.files import read_yaml
from serving.block_manager import BlockManager
from serving.sequence import Sequence

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


# ---- fairness in the scheduler -----------------------------------------------------------------
PREFILL_BURST_STEPS = 16  # the allowance saves at most this many steps' slack


class _Plan(Protocol):
    num_prefill_tokens: int
    shared_step: bool


def reservation(block_manager: BlockManager, seq: Sequence) -> int:
    """KV blocks a sequence may grow to (prompt + max_tokens): what a tenant's quota is checked against."""
    return block_manager.blocks_needed(seq.num_prompt_tokens + seq.params.max_tokens)


def _smallest_first_split(budget: int, demand: dict[str, int]) -> dict[str, int]:
    """The tenant with the least pending prefill is served first and in full, the flood gets the rest:
    a short prompt is never cut into ever smaller pieces behind a long one."""
    shares = dict.fromkeys(demand, 0)
    for tenant in sorted(demand, key=demand.get):
        shares[tenant] = min(demand[tenant], budget)
        budget -= shares[tenant]
    return shares


class TenantFairness:
    """The scheduler's tenant rules: KV-block quotas at admission, tenants admitted in turn, and, while
    several tenants have work, prefill paid from a measured time allowance (see serving/scheduler.py).
    One per scheduler: it keeps the allowance and the decode-step baseline between steps."""

    def __init__(self, kv_limits: Mapping[str, int | float] | None = None, step_slack: float = 0.25,
                 prefill_chunk: int = 64):
        self.kv_limits = dict(kv_limits or {})  # tenant -> blocks (int) or a share of the cache (float)
        self.step_slack = step_slack  # shared steps may be this much slower, on average, than decodes alone
        self.prefill_chunk = prefill_chunk  # prefill tokens a shared step takes when the allowance permits
        self.decode_step_seconds: float | None = None  # moving average of decode-only steps
        self.prefill_allowance = 0.0  # seconds of extra step time shared prefill may still spend
        self.last_tenant: str | None = None
        self.quotas: dict[str, int] = {}
        self._block_manager: BlockManager | None = None
        self._step_tokens = 0

    @classmethod
    def for_tenants(cls, table: TenantTable | None, **settings) -> TenantFairness:
        limits = {n: t.max_kv_blocks for n, t in (table.tenants if table else {}).items() if t.max_kv_blocks}
        return cls(limits, **settings)

    def bind(self, block_manager: BlockManager, step_tokens: int) -> None:
        """Called by the scheduler that owns this: quotas in its blocks, its token budget per step."""
        self._block_manager, self._step_tokens = block_manager, step_tokens
        self.quotas = {name: Tenant(name, limit).kv_block_quota(block_manager.num_blocks)
                       for name, limit in self.kv_limits.items()}

    def shares(self, running: list[Sequence], waiting: Iterable[Sequence]) -> TenantStep:
        """This step's rules: prefill tokens per tenant while several tenants have work, else plain FIFO."""
        demand: dict[str, int] = {}  # tenant -> prompt tokens still to prefill
        for seq in running:
            pending = seq.num_uncomputed_tokens if seq.num_uncomputed_tokens > 1 else 0  # 1 is a decode
            demand[seq.tenant] = demand.get(seq.tenant, 0) + pending
        for seq in waiting:
            demand[seq.tenant] = demand.get(seq.tenant, 0) + seq.num_uncomputed_tokens
        if len(demand) <= 1:
            self.prefill_allowance = 0.0
            return TenantStep(self, running, None)
        decoding = any(s.num_uncomputed_tokens <= 1 for s in running)
        if self.decode_step_seconds is None:
            budget = self._step_tokens  # no baseline measured yet
        elif self.prefill_allowance > 0 or not decoding:  # (with no decodes, gating would stall everyone)
            budget = self.prefill_chunk
        else:
            budget = 0
        shares = _smallest_first_split(budget, demand)
        for tenant in demand.keys() - {s.tenant for s in running}:  # a newcomer's first chunk is not gated
            shares[tenant] = max(shares[tenant], min(demand[tenant], self.prefill_chunk))
        return TenantStep(self, running, shares)

    def record_step(self, plan: _Plan, seconds: float) -> None:
        """Each step's time: decode-only steps set the baseline, shared ones pay."""
        decode = self.decode_step_seconds
        if plan.num_prefill_tokens == 0:
            self.decode_step_seconds = seconds if decode is None else 0.95 * decode + 0.05 * seconds
        if plan.shared_step and decode is not None:
            cap = PREFILL_BURST_STEPS * self.step_slack * decode
            earned = self.step_slack * decode - max(0.0, seconds - decode)
            self.prefill_allowance = min(cap, self.prefill_allowance + earned)

    def within_quota(self, running: list[Sequence], seq: Sequence) -> bool:
        quota = self.quotas.get(seq.tenant)
        if quota is None:
            return True
        held = sum(reservation(self._block_manager, s) for s in running if s.tenant == seq.tenant)
        return held + reservation(self._block_manager, seq) <= quota


class TenantStep:
    """One step under TenantFairness; `shares` is None while at most one tenant has work (plain FIFO)."""

    def __init__(self, fairness: TenantFairness, running: list[Sequence], shares: dict[str, int] | None):
        self.fairness, self.running, self.shares = fairness, running, shares
        self.shared = shares is not None

    def cap(self, seq: Sequence, n: int) -> int:
        return n if self.shares is None else min(n, self.shares[seq.tenant])

    def charge(self, seq: Sequence, n: int) -> None:
        if self.shares is not None:
            self.shares[seq.tenant] = max(0, self.shares[seq.tenant] - n)

    def admitted(self, seq: Sequence) -> None:
        self.fairness.last_tenant = seq.tenant

    def next_waiting(self, waiting: Sequence_[Sequence]) -> Sequence | None:
        """The head of the next tenant's FIFO, tenants taken in turn after the last one admitted;
        tenants whose quota or token share is used up are skipped."""
        if self.shares is None:
            head = waiting[0]
            return head if self.fairness.within_quota(self.running, head) else None
        heads: dict[str, Sequence] = {}
        for seq in waiting:
            heads.setdefault(seq.tenant, seq)
            if len(heads) == len(self.shares):  # every tenant with work has its head: no need to read on
                break
        order = sorted(heads)
        if self.fairness.last_tenant is not None:
            k = bisect.bisect_right(order, self.fairness.last_tenant)
            order = order[k:] + order[:k]
        for tenant in order:
            seq = heads[tenant]
            if self.shares[tenant] > 0 and self.fairness.within_quota(self.running, seq):
                return seq
        return None
