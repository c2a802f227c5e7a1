"""Which sequences run in the next forward pass, and how many tokens each computes.

Every step the continuous scheduler:
  1. advances every running sequence: one decode token, or the next chunk of its prefill,
     within a per-step token budget. If the KV cache has no block for it, the newest running
     sequence is preempted (its blocks freed, recomputed later: it goes back to the *front* of the
     queue and finishes with the same output);
  2. admits waiting requests in arrival order (FIFO; a request that does not fit stops admission,
     nothing skips ahead) while free blocks stay above a watermark, a decode slot is free and token
     budget is left. An admitted request gets its prefill in this same step.
Finished sequences are evicted by the engine right after the step, so the next step's admission
already sees their blocks free.

With several tenants (the server's API keys) two rules keep one tenant from starving another:
admission takes the head of each tenant's FIFO in turn (round-robin), skipping a tenant whose
KV-block quota (`tenant_max_kv_blocks`, reserved for prompt + max_tokens) is full; and while more
than one tenant has work, each gets an equal share of the step's prefill tokens (decode tokens
always run), so a burst of long prompts cannot hold back another tenant's decodes or admission.
Nor may it make their steps slow: the prefill tokens of a shared step are capped at what keeps the
step within `tenant_step_slack` of its decode-only time, as the engine's measured step costs
predict (`step_cost.py`). A share left unused stays unused: isolation is bought with some
throughput, and only while several tenants are active. With one tenant the schedule is exactly the
plain FIFO one.

The static scheduler differs in one rule: it admits a new batch only when every sequence of the
current batch has finished — the head-of-line blocking that continuous batching removes.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from serving.block_manager import BlockManager
from serving.sequence import Sequence, SequenceStatus
from serving.step_cost import StepCostModel


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Continuous batching with KV-budget admission control."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        watermark: float = 0.01,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.tenant_max_kv_blocks: dict[str, int] = {}
        self.tenant_step_slack = 0.25  # a shared step may be this much slower than its decodes alone
        self.step_cost = StepCostModel()  # the engine feeds it every step's tokens and seconds
        self._last_tenant: str | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        batch_open = self._batch_open()
        shares = self._tenant_shares()  # None unless several tenants have work

        # 1. Running sequences first, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if shares is not None and n > 1:  # a prefill chunk stays within its tenant's share
                n = min(n, shares[seq.tenant])
                if n == 0:
                    i += 1
                    continue
            if self._make_room(seq, n, out):
                self.block_manager.append_slots(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                if shares is not None:
                    shares[seq.tenant] = max(0, shares[seq.tenant] - n)
                i += 1

        # 2. Admission, FIFO (per tenant, tenants in turn). No admission in a step that had to preempt.
        while (
            self.waiting
            and not out.preempted
            and batch_open
            and self._has_budget(budget)
            and len(self.running) < self.max_num_seqs
        ):
            seq = self._next_waiting(shares)
            if seq is None or not self._fits(seq):
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._last_tenant = seq.tenant
            n = min(seq.num_uncomputed_tokens, budget)
            if shares is not None:
                n = min(n, shares[seq.tenant])
                shares[seq.tenant] -= max(n, 0)
            if n > 0:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return out

    def finish(self, seq: Sequence) -> None:
        """Evict a finished sequence now, so its blocks are free for the next admission."""
        self.running.remove(seq)
        self.block_manager.free(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq)
                return seq
        return None

    def reserved_blocks(self, tenant: str) -> int:
        """KV blocks a tenant's running sequences may grow to (what its quota is checked against)."""
        return sum(self._reservation(s) for s in self.running if s.tenant == tenant)

    # ---- rules ---------------------------------------------------------------------------------
    def _tenant_shares(self) -> dict[str, int] | None:
        tenants = {s.tenant for s in self.running} | {s.tenant for s in self.waiting}
        if len(tenants) < 2:
            return None
        prefill = self.max_num_batched_tokens
        decodes = sum(1 for s in self.running if s.num_uncomputed_tokens <= 1)
        affordable = self.step_cost.tokens_within(decodes, self.tenant_step_slack)
        if affordable is not None:
            prefill = max(len(tenants), min(prefill, affordable))
        return dict.fromkeys(tenants, max(1, prefill // len(tenants)))

    def _next_waiting(self, shares: dict[str, int] | None) -> Sequence | None:
        """The head of the next tenant's FIFO, tenants taken in turn after the last one admitted;
        tenants whose quota or token share is used up are skipped."""
        heads: dict[str, Sequence] = {}
        for seq in self.waiting:
            heads.setdefault(seq.tenant, seq)
        order = sorted(heads)
        if self._last_tenant is not None:
            k = bisect.bisect_right(order, self._last_tenant)
            order = order[k:] + order[:k]
        for tenant in order:
            seq = heads[tenant]
            if shares is not None and shares[tenant] <= 0:
                continue
            if self._within_quota(seq):
                return seq
        return None

    def _within_quota(self, seq: Sequence) -> bool:
        quota = self.tenant_max_kv_blocks.get(seq.tenant)
        return quota is None or self.reserved_blocks(seq.tenant) + self._reservation(seq) <= quota

    def _reservation(self, seq: Sequence) -> int:
        return self.block_manager.blocks_needed(seq.num_prompt_tokens + seq.params.max_tokens)

    def _batch_open(self) -> bool:
        return True

    def _has_budget(self, budget: int) -> bool:
        return budget > 0

    def _fits(self, seq: Sequence) -> bool:
        need = self.block_manager.num_new_blocks_for_prompt(seq)
        free = self.block_manager.num_free_blocks
        if not self.running:  # alone it may use everything; the watermark protects running sequences
            return need <= free
        return free - need >= self.watermark_blocks

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can grow; False if `seq` itself went."""
        while not self.block_manager.can_append(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        if seq.wants_prompt_logprobs:
            seq.prompt_logprobs = [None]
        self.num_preemptions += 1
        self.waiting.appendleft(seq)


class StaticScheduler(Scheduler):
    """Static batching: a new batch is formed only when the whole current batch has finished."""

    def _batch_open(self) -> bool:
        return not self.running

    def _has_budget(self, budget: int) -> bool:
        return True  # the whole batch is admitted at once; its prefill is chunked over the next steps


SCHEDULERS: dict[str, type[Scheduler]] = {"continuous": Scheduler, "static": StaticScheduler}
