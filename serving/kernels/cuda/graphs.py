"""Decode steps captured in CUDA graphs, one per bucketed batch size, replayed over static buffers.

A decode step of n sequences is padded to the smallest bucket b >= n: rows n..b get token 0 at position 0,
slot -1 (the store skips it), an all-zero block table and context length 0 (attention yields zeros), so
padding never touches the cache and the first n rows of the output are the unpadded step's. Every graph reads
the same static buffers (inputs, slots, block tables, lengths), filled before each replay. A bucket is
captured the first time a step needs it, after one eager run of the same call (which compiles the Triton
kernels; its outputs are the step's). On CPU, `EagerGraph` stands in for the CUDA graph: it reruns the call
over the same padded buffers, so the bucketing and padding are checked without a GPU.

Layers whose forward waits on the host cannot be captured: bitsandbytes' LLM.int8() with an outlier threshold
looks for outlier columns in every call (`if outliers.any()`, then columns of data-dependent count). With such
a layer (`capture_blocker`), or when a capture fails, the buckets run eagerly over the same padded buffers,
said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from serving.kernels.cuda.step import PagedStep
from serving.model.attention import AttentionContext

Forward = Callable[[AttentionContext, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
log = logging.getLogger(__name__)


def capture_blocker(model: torch.nn.Module | None) -> str | None:
    """The name of the first module whose forward syncs with the host (so no graph can hold it), or None."""
    if model is None:
        return None
    for name, module in model.named_modules():
        state = getattr(module, "state", None)
        if type(module).__name__ == "Linear8bitLt" and float(getattr(state, "threshold", 0.0) or 0.0) > 0:
            return f"{name} (bitsandbytes LLM.int8() with outlier threshold {state.threshold})"
    return None


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return [*sizes, max_batch]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n rows, or None when n exceeds the largest."""
    return next((b for b in buckets if b >= n), None)


class EagerGraph:
    """CPU stand-in for a captured graph: `replay` reruns the call over the same static buffers."""

    def __init__(self, call: Callable[[], torch.Tensor]):
        self.call = call
        self.output = call()

    def replay(self) -> None:
        self.output = self.call()


class CudaGraph:
    def __init__(self, call: Callable[[], torch.Tensor], pool):
        self.output = call()  # eager first: compiles the kernels outside the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = call()
        self.graph.replay()  # capture records without running: fill `output` for this step

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class StaticDecodeBuffers:
    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64, -1 on padding rows
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    context_lens: torch.Tensor  # [max_batch] int32, 0 on padding rows
    keep_rows: torch.Tensor  # [max_batch] arange: every row's logits

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> StaticDecodeBuffers:
        def longs():
            return torch.zeros(max_batch, dtype=torch.long, device=device)

        return cls(longs(), longs(), longs(), torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
                   torch.zeros(max_batch, dtype=torch.int32, device=device),
                   torch.arange(max_batch, device=device))

    def fill(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]], lengths: Sequence[int], bucket: int) -> None:
        """Rows 0..n from the step, rows n..bucket padding; one host-to-device copy."""
        n, width = len(lengths), self.block_tables.shape[1]
        host = torch.zeros(bucket, 4 + width, dtype=torch.long)
        host[:, 2] = -1
        host[:n, :4] = torch.tensor([list(input_ids), list(positions), list(slots), list(lengths)]).T
        for i, table in enumerate(tables):
            host[i, 4 : 4 + len(table)] = torch.tensor(table)
        dev = host.to(self.input_ids.device)
        self.input_ids[:bucket].copy_(dev[:, 0])
        self.positions[:bucket].copy_(dev[:, 1])
        self.slot_mapping[:bucket].copy_(dev[:, 2])
        self.context_lens[:bucket].copy_(dev[:, 3])
        self.block_tables[:bucket].copy_(dev[:, 4:])


class DecodeGraphs:
    """Pure-decode steps of up to `max_batch` sequences with block tables up to `max_blocks` wide."""

    def __init__(self, forward: Forward, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                 block_size: int, max_batch: int, max_blocks: int, device: torch.device):
        self.forward = forward
        self.k_cache, self.v_cache, self.block_size = k_cache, v_cache, block_size
        self.device = torch.device(device)
        self.buckets = batch_buckets(max_batch)
        self.buffers = StaticDecodeBuffers.allocate(max_batch, max_blocks, self.device)
        self.graphs: dict[int, EagerGraph | CudaGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.eager_reason = capture_blocker(getattr(forward, "model", None)) if self.pool is not None else None
        if self.eager_reason:
            log.warning("decode steps run eagerly over the graph buffers: %s cannot be captured", self.eager_reason)

    def fits(self, num_seqs: int, widest_table: int) -> bool:
        return num_seqs <= self.buckets[-1] and widest_table <= self.buffers.block_tables.shape[1]

    def run(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]], lengths: Sequence[int]) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n sequences (check `fits` first)."""
        n = len(lengths)
        bucket = bucket_for(n, self.buckets)
        self.buffers.fill(input_ids, positions, slots, tables, lengths, bucket)
        graph = self.graphs.get(bucket)
        if graph is None:
            self.graphs[bucket] = self._capture(self._call(bucket))
        else:
            graph.replay()
        return self.graphs[bucket].output[:n]

    def _capture(self, call: Callable[[], torch.Tensor]) -> EagerGraph | CudaGraph:
        if self.pool is None or self.eager_reason:
            return EagerGraph(call)
        try:
            return CudaGraph(call, self.pool)
        except RuntimeError as exc:  # a host sync or an op CUDA graphs refuse: this and later buckets run eagerly
            self.eager_reason = f"capture failed: {exc}"
            log.warning("decode steps run eagerly over the graph buffers: %s", self.eager_reason)
            torch.cuda.synchronize()
            return EagerGraph(call)

    def _call(self, bucket: int) -> Callable[[], torch.Tensor]:
        buf = self.buffers
        empty = torch.zeros(0, dtype=torch.int32, device=self.device)
        step = PagedStep(buf.block_tables[:bucket], buf.context_lens[:bucket], empty.view(0, 1), empty, empty,
                         empty, 0)
        ctx = AttentionContext(self.k_cache, self.v_cache, self.block_size, buf.slot_mapping[:bucket], paged=step)
        ids, positions, keep = buf.input_ids[:bucket], buf.positions[:bucket], buf.keep_rows[:bucket]
        return lambda: self.forward(ctx, ids, positions, keep)
