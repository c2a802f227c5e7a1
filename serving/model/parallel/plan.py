"""A step's schedule as plain data: what rank 0 broadcasts so every rank builds the same forward pass.

The scheduler and the block tables live on rank 0 only. Each step it sends, per scheduled sequence,
just what the model runner reads: the tokens to compute now, where they sit in the sequence, the block
table, and the counts that decide which rows are kept for logits. Other ranks rebuild light sequences
from it and run their own shard (or stage) of the same forward pass against their own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.core.scheduler import ScheduledSeq
from serving.core.sequence import Sequence

STOP = "stop"
STEP = "step"
STATS = "stats"
RESET = "reset"


@dataclass
class SeqPlan:
    request_id: str
    start: int  # tokens already in the KV cache
    tokens: list[int]  # the tokens computed this step (positions start..start+len)
    block_table: list[int]
    num_tokens: int
    num_prompt_tokens: int
    wants_prompt_logprobs: bool
    prompt_score_from: int = 1


@dataclass
class _RemoteSeq:
    """The fields of a Sequence that the model runner reads, rebuilt on a rank without the scheduler."""

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    wants_prompt_logprobs: bool
    prompt_score_from: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def plan_of(scheduled: list[ScheduledSeq]) -> list[SeqPlan]:
    out = []
    for item in scheduled:
        seq: Sequence = item.seq
        start = seq.num_computed_tokens
        out.append(SeqPlan(seq.request_id, start, seq.token_ids[start : start + item.num_new_tokens],
                           list(seq.block_table), seq.num_tokens, seq.num_prompt_tokens, seq.wants_prompt_logprobs,
                           seq.prompt_score_from))
    return out


def scheduled_from(plan: list[SeqPlan]) -> list[ScheduledSeq]:
    """Sequences whose tokens are right where this step reads them (elsewhere placeholders)."""
    out = []
    for p in plan:
        ids = [0] * p.num_tokens
        ids[p.start : p.start + len(p.tokens)] = p.tokens
        seq = _RemoteSeq(p.request_id, ids, p.start, p.block_table, p.num_prompt_tokens, p.wants_prompt_logprobs,
                         p.prompt_score_from)
        out.append(ScheduledSeq(seq, len(p.tokens)))  # type: ignore[arg-type]
    return out


def split_microbatches(scheduled: list[ScheduledSeq], m: int) -> list[list[ScheduledSeq]]:
    """Up to m contiguous micro-batches with about equal token counts (each at least one sequence)."""
    m = max(1, min(m, len(scheduled)))
    total = sum(s.num_new_tokens for s in scheduled)
    out: list[list[ScheduledSeq]] = [[]]
    done = 0
    for i, item in enumerate(scheduled):
        left = len(scheduled) - i
        if out[-1] and len(out) < m and (done >= total * len(out) / m or left <= m - len(out)):
            out.append([])
        out[-1].append(item)
        done += item.num_new_tokens
    return out
