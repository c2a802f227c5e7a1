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

With several tenants (the server's API keys) a `TenantFairness` (serving/core/fairness.py), given at
construction, keeps one tenant from starving another: admission takes the head of each tenant's FIFO
in turn (round-robin), skipping a tenant whose KV-block quota (reserved for prompt + max_tokens) is
full; and while more than one tenant has work, prefill is paid for from a time allowance, so a burst
of long prompts can neither hold back another tenant's decodes nor make its steps slow. Each shared
step earns `step_slack` x (a decode-only step's measured time) and is charged what it actually took
beyond a decode-only step; prefill chunks (`prefill_chunk` tokens, the tenant with the least
pending prefill first) run only while the allowance is positive or nobody decodes, so on average
shared steps stay within the slack whatever the hardware. A tenant with nothing running gets its
first chunk at once (charged, not gated): a newcomer's short prompt never waits behind a flood.
Decode tokens always run. Isolation is bought with the flooding tenant's prefill throughput, and
only while several tenants are active. With one tenant the schedule is exactly the plain FIFO one;
without a TenantFairness every step is plain FIFO.

The static scheduler differs in one rule: it admits a new batch only when every sequence of the
current batch has finished — the head-of-line blocking that continuous batching removes.
"""

from __future__ import annotations

from collections import Counter, deque

from serving.core.block_manager import BlockManager
from serving.core.fairness import TenantFairness, reservation
from serving.core.scheduler_interface import ScheduledSeq, SchedulerInterface, SchedulerOutput, TenantLoad
from serving.core.sequence import Sequence, SequenceStatus

__all__ = ["MAX_NUM_BATCHED_TOKENS", "ScheduledSeq", "Scheduler", "SchedulerOutput", "StaticScheduler"]

# Tokens per step: a larger budget reads the weights once for more prefill per step, which raised
# throughput and cut TTFT p99 under many concurrent requests (docs/results/design-figures.md).
MAX_NUM_BATCHED_TOKENS = 2048


class FifoStep:
    """A step without tenant rules: every sequence may take what the token budget leaves."""

    shared = False

    def __init__(self, running: list[Sequence]):
        pass

    def cap(self, seq: Sequence, n: int) -> int:
        return n

    def charge(self, seq: Sequence, n: int) -> None:
        pass

    def admitted(self, seq: Sequence) -> None:
        pass

    def next_waiting(self, waiting: deque[Sequence]) -> Sequence | None:
        return waiting[0]


class Scheduler(SchedulerInterface):
    """Continuous batching with KV-budget admission control."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
        watermark: float = 0.01,
        fairness: TenantFairness | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = max(1, int(watermark * block_manager.num_blocks))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.fairness = fairness
        if fairness is not None:
            fairness.bind(block_manager, max_num_batched_tokens)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        batch_open = self._batch_open()
        step = self.fairness.shares(self.running, self.waiting) if self.fairness else FifoStep(self.running)
        out = SchedulerOutput(shared_step=step.shared)

        # 1. Running sequences first, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 1 and (n := step.cap(seq, n)) == 0:  # a prefill chunk may be held back this step
                i += 1
                continue
            if self._make_room(seq, n, out):
                self.block_manager.append_slots(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                step.charge(seq, n)
                i += 1

        # 2. Admission, FIFO (or the step's order). No admission in a step that had to preempt.
        while (
            self.waiting
            and not out.preempted
            and batch_open
            and self._has_budget(budget)
            and len(self.running) < self.max_num_seqs
        ):
            seq = step.next_waiting(self.waiting)
            if seq is None or not self._fits(seq):
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.admitted(seq)
            n = step.cap(seq, min(seq.num_uncomputed_tokens, budget))
            step.charge(seq, n)
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
        return sum(reservation(self.block_manager, s) for s in self.running if s.tenant == tenant)

    @property
    def tenant_max_kv_blocks(self) -> dict[str, int]:
        """Each tenant's KV-block quota (read by the engine to refuse a request no quota could admit)."""
        return self.fairness.quotas if self.fairness else {}

    def tenant_load(self) -> TenantLoad:
        running, waiting = list(self.running), list(self.waiting)  # copied at once: stats may be read off-thread
        blocks: Counter[str] = Counter()
        for seq in running:
            blocks[seq.tenant] += len(seq.block_table)
        return TenantLoad(dict(Counter(s.tenant for s in running)), dict(Counter(s.tenant for s in waiting)),
                          dict(blocks))

    def step_done(self, plan: SchedulerOutput, seconds: float) -> None:
        """The engine reports each step's time (the tenant rules' time allowance is measured in it)."""
        if self.fairness is not None:
            self.fairness.record_step(plan, seconds)

    # ---- rules ---------------------------------------------------------------------------------
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

