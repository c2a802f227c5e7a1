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

The static scheduler differs in one rule: it admits a new batch only when every sequence of the
current batch has finished — the head-of-line blocking that continuous batching removes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serving.block_manager import BlockManager
from serving.sequence import Sequence, SequenceStatus


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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        batch_open = self._batch_open()

        # 1. Running sequences first, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if self._make_room(seq, n, out):
                self.block_manager.append_slots(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1

        # 2. Admission, FIFO. No admission in a step that had to preempt.
        while (
            self.waiting
            and not out.preempted
            and batch_open
            and self._has_budget(budget)
            and len(self.running) < self.max_num_seqs
            and self._fits(self.waiting[0])
        ):
            seq = self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
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


SCHEDULERS: dict[str, type[Scheduler]] = {"continuous": Scheduler, "static": StaticScheduler}
