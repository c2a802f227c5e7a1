"""What each rank runs per step: rank 0's drivers (in front of the engine's model runner) and the other
ranks' loop. Every rank runs the same forward pass over its own shard or stage and its own KV cache."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from serving.core.scheduler import ScheduledSeq
from serving.model.model_runner import ModelRunner, StepResult
from serving.model.parallel.plan import RESET, STATS, STEP, STOP, plan_of, scheduled_from, split_microbatches
from serving.model.parallel.sharding import STATS as COMM
from serving.model.parallel.sharding import StageDone, StageState


class RankFailedError(RuntimeError):
    """A rank died or its collective failed: the parallel engine cannot go on."""


def broadcast(obj=None, device: torch.device | None = None):
    """Rank 0 sends `obj` to every rank; the others receive it."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device if device is not None and device.type == "cuda" else None)
    if dist.get_rank() == 0:
        import pickle

        COMM.control_bytes += len(pickle.dumps(obj))
    return box[0]


class WorkerRunner(ModelRunner):
    """A non-zero rank's runner: the same forward pass, no sampling (rank 0 samples)."""

    def _postprocess(self, scheduled, logits, sample_idx, prompt_rows) -> StepResult:
        return StepResult({}, {}, {})


class _Driver:
    """Rank 0's stand-in for the engine's ModelRunner; everything but `run` is the runner's own."""

    def __init__(self, runner: ModelRunner, group):
        self.__dict__["runner"] = runner
        self.__dict__["group"] = group

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.runner, name, value)

    def run(self, scheduled: list[ScheduledSeq]) -> StepResult:
        self.group.check()
        start = time.perf_counter()
        try:
            return self._run(scheduled)
        except RankFailedError:
            raise
        except RuntimeError as exc:
            self.group.collective_failed(exc)
            raise RankFailedError(self.group.failure) from exc
        finally:
            COMM.step_s += time.perf_counter() - start

    def _run(self, scheduled: list[ScheduledSeq]) -> StepResult:
        raise NotImplementedError


class TensorParallelDriver(_Driver):
    def _run(self, scheduled: list[ScheduledSeq]) -> StepResult:
        broadcast((STEP, plan_of(scheduled)), self.runner.device)
        COMM.steps += 1
        return self.runner.run(scheduled)


class PipelineDriver(_Driver):
    """Stage 0 + the head. Micro-batches go down the pipeline one after another (sends don't wait), so
    stage 1 works on micro-batch k while stage 0 computes k + 1; the last stage's rows come back for the
    norm's output to be projected and sampled here."""

    def __init__(self, runner: ModelRunner, group, state: StageState, num_microbatches: int, hidden_size: int):
        super().__init__(runner, group)
        self.__dict__.update(state=state, num_microbatches=num_microbatches, hidden_size=hidden_size)

    def set_microbatches(self, m: int) -> None:
        if m < 1:
            raise ValueError(f"micro-batches must be at least 1, got {m}")
        self.__dict__["num_microbatches"] = m

    def _run(self, scheduled: list[ScheduledSeq]) -> StepResult:
        mbs = split_microbatches(scheduled, self.num_microbatches)
        broadcast((STEP, [plan_of(mb) for mb in mbs]), self.runner.device)
        COMM.steps += 1
        last = dist.get_world_size() - 1
        sends = []
        for k, mb in enumerate(mbs):
            hidden = _run_stage(self.runner, mb)
            sends.append(_isend(hidden, 1, k))
        result = StepResult({}, {}, {})
        offset = 0
        for k, mb in enumerate(mbs):
            rows = _recv_rows(last, k, self.hidden_size, self.runner.shape.dtype, self.runner.device)
            start = time.perf_counter()
            self.state.received, self.state.head_mode = rows, True
            try:
                part = self.runner.run(mb)
            finally:
                self.state.received, self.state.head_mode = None, False
            COMM.busy_s += time.perf_counter() - start
            for mine, theirs in ((result.sampled, part.sampled), (result.logprobs, part.logprobs),
                                 (result.prompt_logprobs, part.prompt_logprobs)):
                mine.update({offset + i: v for i, v in theirs.items()})
            offset += len(mb)
        for req in sends:
            req.wait()
        return result


def _run_stage(runner: ModelRunner, scheduled: list[ScheduledSeq]) -> torch.Tensor:
    start = time.perf_counter()
    try:
        runner.run(scheduled)
    except StageDone as done:
        return done.hidden.contiguous()
    finally:
        COMM.busy_s += time.perf_counter() - start
    raise RuntimeError("the pipeline stage ran to the end without reaching its exit")


def _isend(t: torch.Tensor, dst: int, tag: int):
    start = time.perf_counter()
    req = dist.isend(t, dst, tag=tag)
    COMM.p2p_s += time.perf_counter() - start
    COMM.p2p_bytes += t.numel() * t.element_size()
    return req


def _recv(t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
    start = time.perf_counter()
    dist.recv(t, src, tag=tag)
    COMM.p2p_s += time.perf_counter() - start
    return t


def _recv_rows(src: int, tag: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, rows, hidden]: a length header, then the rows."""
    n = int(_recv(torch.zeros(1, dtype=torch.long, device=device), src, tag).item())
    rows = torch.empty(1, n, hidden, dtype=dtype, device=device)
    return _recv(rows, src, tag) if n else rows


# ---- the other ranks ---------------------------------------------------------------------------
def serve_rank(runner: WorkerRunner, mode: str, state: StageState | None, hidden_size: int) -> None:
    """Follow rank 0's messages until it says stop (or a collective fails because a rank went away)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    while True:
        kind, *payload = broadcast(None, runner.device)
        if kind == STOP:
            return
        if kind == STATS:
            dist.gather_object(dict(COMM.__dict__), None, dst=0)
            continue
        if kind == RESET:
            COMM.reset()
            continue
        COMM.steps += 1
        if mode == "tp":
            runner.run(scheduled_from(payload[0]))
            continue
        sends = []
        for k, plan in enumerate(payload[0]):
            tokens = sum(len(p.tokens) for p in plan)
            state.received = _recv(torch.empty(1, tokens, hidden_size, dtype=runner.shape.dtype,
                                               device=runner.device), rank - 1, k)
            out = _run_stage(runner, scheduled_from(plan))
            if rank == world - 1:  # the norm's output rows that the head keeps, back to rank 0
                rows = out.reshape(-1, out.shape[-1])
                sends.append(_isend(torch.tensor([rows.shape[0]], device=runner.device), 0, k))
                if rows.shape[0]:
                    sends.append(_isend(rows[None], 0, k))
            else:
                sends.append(_isend(out, rank + 1, k))
        state.received = None
        for req in sends:
            req.wait()


def gather_stats(device: torch.device | None = None) -> list[dict]:
    """Rank 0: every rank's CommStats, rank order."""
    broadcast((STATS,), device)
    out: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.gather_object(dict(COMM.__dict__), out, dst=0)
    return out


def reset_stats(device: torch.device | None = None) -> None:
    broadcast((RESET,), device)
    COMM.reset()
