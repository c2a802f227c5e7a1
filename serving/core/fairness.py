"""The scheduler's tenant rules: KV-block quotas at admission, tenants admitted in turn, and prefill paid from
a measured time allowance while several tenants have work (the rules are described in serving/core/scheduler.py).

Apart from the API-key file and authentication (serving/http/tenants.py), so the scheduler imports no file parsing.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Sequence_
from typing import Protocol

from serving.core.block_manager import BlockManager
from serving.core.sequence import Sequence

PREFILL_BURST_STEPS = 16  # the allowance saves at most this many steps' slack


def kv_block_quota(max_kv_blocks: int | float | None, num_blocks: int) -> int | None:
    """A tenant's KV-block limit in blocks: an int is a number of blocks, a float in (0, 1] a share."""
    if max_kv_blocks is None:
        return None
    if isinstance(max_kv_blocks, float):
        return max(1, math.floor(max_kv_blocks * num_blocks))
    return min(max_kv_blocks, num_blocks)


class _Limited(Protocol):
    max_kv_blocks: int | float | None


class _Table(Protocol):
    """What `for_tenants` reads of a serving.http.tenants.TenantTable."""

    tenants: Mapping[str, _Limited]


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
    several tenants have work, prefill paid from a measured time allowance (see serving/core/scheduler.py).
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
    def for_tenants(cls, table: _Table | None, **settings) -> TenantFairness:
        limits = {n: t.max_kv_blocks for n, t in (table.tenants if table else {}).items() if t.max_kv_blocks}
        return cls(limits, **settings)

    def bind(self, block_manager: BlockManager, step_tokens: int) -> None:
        """Called by the scheduler that owns this: quotas in its blocks, its token budget per step."""
        self._block_manager, self._step_tokens = block_manager, step_tokens
        self.quotas = {name: kv_block_quota(limit, block_manager.num_blocks)
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
