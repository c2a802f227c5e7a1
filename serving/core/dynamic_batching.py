"""Dynamic batching: a batch closes on whichever fires first, size or timeout, then runs as a static batch.

Requests queue until `max_num_seqs` (the batch size B) are waiting or the oldest has waited
`batch_timeout_s` (T); then up to B of them are admitted together and run to completion as one static
batch (no admission until the whole batch has finished), through the real model.

Our paged engine never computes a finished row, so the padding a padded implementation pays is counted,
not spent: a `[n, P + O]` batch (prompts padded to the longest prompt P, every row decoding for the
longest output O) holds n·(P + O) token slots, of which Σ(pᵢ + oᵢ) are useful. `padding_waste` is the
padded slots over the useful ones, which is what a small T (short requests leave early, tiny batches)
trades against a large B (one long request pads everyone).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.core.scheduler import SchedulerOutput, StaticScheduler
from serving.core.sequence import Sequence

DEFAULT_BATCH_TIMEOUT_S = 0.05
IDLE_WAIT_S = 0.001  # how long one empty step waits for the timeout, so an idle queue does not spin a core


@dataclass
class DynamicBatch:
    """One closed batch: why it closed and, once every member has finished, its shape."""

    reason: str  # "size" | "timeout"
    closed_at: float  # on the scheduler's clock
    oldest_wait_s: float  # how long its oldest member had queued when it closed
    request_ids: list[str]
    lengths: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (prompt, output) tokens

    @property
    def size(self) -> int:
        return len(self.request_ids)

    @property
    def done(self) -> bool:
        return len(self.lengths) == len(self.request_ids)

    @property
    def useful_slots(self) -> int:
        return sum(p + o for p, o in self.lengths.values())

    @property
    def padded_slots(self) -> int:
        """Slots a padded [n, max prompt + max output] batch holds beyond the useful ones."""
        if not self.lengths:
            return 0
        longest_prompt = max(p for p, _ in self.lengths.values())
        longest_output = max(o for _, o in self.lengths.values())
        return len(self.lengths) * (longest_prompt + longest_output) - self.useful_slots


class DynamicBatchScheduler(StaticScheduler):
    """Static batches that close on size (B = max_num_seqs waiting) or timeout (oldest waited T)."""

    def __init__(
        self,
        *args,
        batch_timeout_s: float = DEFAULT_BATCH_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        idle_wait: Callable[[float], None] = time.sleep,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if batch_timeout_s < 0:
            raise ValueError(f"batch_timeout_s must be >= 0, got {batch_timeout_s}")
        self.batch_timeout_s = batch_timeout_s
        self.clock = clock
        self.idle_wait = idle_wait
        self.batches: list[DynamicBatch] = []
        self._queued_at: dict[str, float] = {}  # request id -> when it joined the queue
        self._current: DynamicBatch | None = None

    @property
    def max_batch_size(self) -> int:
        return self.max_num_seqs

    def add(self, seq: Sequence) -> None:
        self._queued_at.setdefault(seq.request_id, self.clock())
        super().add(seq)

    def close_reason(self) -> str | None:
        """"size" or "timeout" when a batch may close now, else None (also while a batch runs)."""
        if self.running or not self.waiting:
            return None
        if len(self.waiting) >= self.max_batch_size:
            return "size"
        if self._oldest_wait() >= self.batch_timeout_s:
            return "timeout"
        return None

    def schedule(self) -> SchedulerOutput:
        reason = None if self.running else self.close_reason()
        if not self.running and reason is None:
            if self.waiting:  # wait a little for the timeout instead of spinning the engine loop
                self.idle_wait(min(IDLE_WAIT_S, max(0.0, self.batch_timeout_s - self._oldest_wait())))
            return SchedulerOutput()
        oldest = self._oldest_wait()
        out = super().schedule()
        if reason is not None and self.running:
            self._current = DynamicBatch(reason, self.clock(), oldest, [s.request_id for s in self.running])
            self.batches.append(self._current)
        return out

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._record(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = super().abort(request_id)
        if seq is not None:
            self._record(seq)
        return seq

    def padding_waste(self) -> float | None:
        """Padded token slots over useful ones, over every finished batch so far."""
        done = [b for b in self.batches if b.done]
        useful = sum(b.useful_slots for b in done)
        return sum(b.padded_slots for b in done) / useful if useful else None

    def _record(self, seq: Sequence) -> None:
        self._queued_at.pop(seq.request_id, None)
        batch = self._current
        if batch is not None and seq.request_id in batch.request_ids:
            batch.lengths[seq.request_id] = (seq.num_prompt_tokens, seq.num_output_tokens)

    def _batch_open(self) -> bool:
        return not self.running and self.close_reason() is not None

    def _oldest_wait(self) -> float:
        if not self.waiting:
            return 0.0
        now = self.clock()
        return max(now - self._queued_at.get(s.request_id, now) for s in self.waiting)
