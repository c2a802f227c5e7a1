"""Cutting an unmodified HF Llama/Qwen2 model across ranks: tensor-parallel shards and pipeline stages.

Tensor parallelism (Megatron-style): q/k/v and gate/up become column-parallel (each rank keeps a slice
of the output features, no communication), o and down row-parallel (each rank multiplies its slice of
the input features and an all-reduce sums the partial results). Attention is split by KV head: rank r
keeps a contiguous range of KV heads and the query heads of their GQA groups, so its paged KV cache holds
only those heads. Heads are split as evenly as the KV heads allow (SmolLM2's 3 KV heads on 2 ranks:
2 + 1), so every rank's config carries its own head counts.

Shards are cut from the weights as loaded, before the engine packs them for its kernels (model_runner's
`load_model` runs `shard_model` first): the packed layouts (oneDNN's opaque tensor, the bf16 pair and wo_fp32
tiles) have no rows to slice, and each shard is packed on its own afterwards, on whatever path the rank takes.
int8 weight-only layers shard too (per-output-channel scales: a slice of the codes and of the scales is exact);
int4's groups run along the input, so row-parallel slices would cut its packed 64-row blocks and groups: refused.

Pipeline parallelism: rank s keeps a contiguous range of decoder layers; the others are replaced by
stubs so the HF forward still runs end to end: a stage's first stub yields the activations the previous
stage sent, and the stage stops (raises `StageDone`) where its range ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from serving.kernels.cpu import isa as isas
from serving.model.quant.int8 import Int8WeightOnlyLinear

COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclass
class CommStats:
    """What this rank sent through collectives and point-to-point, and how long it waited for them."""

    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    allreduce_s: float = 0.0
    p2p_bytes: int = 0
    p2p_s: float = 0.0
    control_bytes: int = 0  # pickled step plans broadcast by rank 0
    busy_s: float = 0.0  # time in forward passes (pipeline stages)
    step_s: float = 0.0  # rank 0: wall time of its steps, from the plan's broadcast to the sampled tokens
    steps: int = 0

    def reset(self) -> None:
        for name, value in CommStats().__dict__.items():
            setattr(self, name, value)


STATS = CommStats()  # one per process: every rank is its own process


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's slice of the input features; the bias is added once.

    The slice is a child module (`linear`), not this module's own weight, so the engine's packing swaps it
    for a packed one like any other projection while the all-reduce stays here."""

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None, group=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).contiguous()
        start = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        STATS.allreduce_s += time.perf_counter() - start
        STATS.allreduce_calls += 1
        STATS.allreduce_bytes += y.numel() * y.element_size()
        return y if self.bias is None else y + self.bias.to(y.dtype)


def split_evenly(n: int, parts: int) -> list[range]:
    """Contiguous ranges of 0..n-1, sizes differing by at most one, larger ones first."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


SHARDABLE = (nn.Linear, Int8WeightOnlyLinear)


def check_shardable(model, world_size: int) -> None:
    """Refuse, naming why, what these shards cannot split: too few KV heads, layers with no rows to slice."""
    config = _text_config(model)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads < world_size:
        raise ValueError(f"tensor_parallel_size {world_size} needs at least {world_size} KV heads to split; "
                         f"this model has {kv_heads}")
    for i, layer in enumerate(model.model.layers):
        for name in COLUMN_PARALLEL + ROW_PARALLEL:
            module = layer.get_submodule(name)
            if type(module) not in SHARDABLE:
                raise ValueError(f"tensor parallelism cannot shard layer {i} {name}: {_why_not(module)}; serve it "
                                 "with tensor_parallel_size=1 or pipeline_parallel_size (stages keep layers whole)")


def _why_not(module: nn.Module) -> str:
    """Why a projection cannot be sharded, for the refusal."""
    kind = f"{type(module).__module__}.{type(module).__name__}"
    if type(module).__module__ == "serving.model.packed_linear":
        return (f"it is {kind}, the engine's own weight packing, applied before sharding (packed layouts have "
                "no rows to slice: shard the plain model, then pack)")
    if type(module).__name__ == "Int4WeightOnlyLinear":
        return (f"it is {kind}, whose int4 groups run along the input and whose kernel layouts pack 64 output "
                "rows at a time: the shards would cut both (int8wo and the plain model shard)")
    return f"it is {kind}, a layer whose weight layout these shards do not know (plain nn.Linear and int8wo do)"


def shard_model(model, rank: int, world_size: int, group=None):
    """Replace each decoder layer's projections by this rank's shards and set its head counts."""
    check_shardable(model, world_size)
    config = _text_config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    group_size = heads // kv_heads
    kv = split_evenly(kv_heads, world_size)[rank]
    q = range(kv.start * group_size, kv.stop * group_size)
    ffn = split_evenly(config.intermediate_size, world_size)[rank]
    rows = {"q_proj": _rows(q, head_dim), "k_proj": _rows(kv, head_dim), "v_proj": _rows(kv, head_dim),
            "gate_proj": slice(ffn.start, ffn.stop), "up_proj": slice(ffn.start, ffn.stop)}
    cols = {"o_proj": _rows(q, head_dim), "down_proj": slice(ffn.start, ffn.stop)}
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, sl in rows.items():
                if hasattr(parent, name):
                    setattr(parent, name, _column(getattr(parent, name), sl))
            for name, sl in cols.items():
                if hasattr(parent, name):
                    old = getattr(parent, name)
                    bias = old.bias.detach() if old.bias is not None and rank == 0 else None
                    setattr(parent, name, RowParallelLinear(_input_slice(old, sl), bias, group))
    config.head_dim = head_dim  # before the head counts change, so hidden_size // heads is not used
    config.num_attention_heads = len(q)
    config.num_key_value_heads = len(kv)
    config.intermediate_size = len(ffn)
    return model


def _rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def _column(old: nn.Module, rows: slice) -> nn.Module:
    """This rank's output rows of a column-parallel projection (with their bias)."""
    bias = None if old.bias is None else old.bias.detach()[rows].contiguous()
    if isinstance(old, Int8WeightOnlyLinear):
        return _int8_part(old, old.plain_weight()[rows], old.scales[rows], bias)
    return _linear(old.weight.detach()[rows].contiguous(), bias)


def _input_slice(old: nn.Module, cols: slice) -> nn.Module:
    """This rank's input features of a row-parallel projection, without a bias (RowParallelLinear adds it)."""
    if isinstance(old, Int8WeightOnlyLinear):  # scales are per output row: all of them apply to every slice
        return _int8_part(old, old.plain_weight()[:, cols], old.scales, None)
    return _linear(old.weight.detach()[:, cols].contiguous(), None)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    new.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        new.bias = nn.Parameter(bias, requires_grad=False)
    return new


def _int8_part(old: Int8WeightOnlyLinear, codes: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None) -> Int8WeightOnlyLinear:
    """An int8 layer over a slice of `old`'s codes, on `old`'s kernel path, packed and serving from its kernel
    layout alone as a loaded variant's layers do (the plain slice is a transient copy)."""
    device = codes.device
    with isas.using(old.isa):  # the layer records the path in force when it is built
        new = Int8WeightOnlyLinear(codes.shape[1], codes.shape[0], bias is not None,
                                   bias.dtype if bias is not None else torch.float32).to(device)
    new.weight_int8, new.scales = codes.contiguous(), scales.contiguous()
    if bias is not None:
        new.bias = nn.Parameter(bias, requires_grad=False)
    new.drop_plain()
    return new


def drop_other_stages_kv(runner, layers: range) -> None:
    """A stage's paged KV cache keeps only its own layers' tensors (the others are never read)."""
    for cache in (runner.k_cache, runner.v_cache, runner.k_scale, runner.v_scale):
        for i in range(len(cache or [])):
            if i not in layers:
                cache[i] = cache[i].new_empty((0,))


# ---- pipeline stages ---------------------------------------------------------------------------
class StageDone(Exception):  # noqa: N818 (control flow, not an error)
    """Raised where a stage's layers end, carrying the activations to hand on."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage done")
        self.hidden = hidden


class StageState:
    """Per process: what the next stub hands in, and whether rank 0 is running a stage or the head."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None
        self.head_mode = False
        self.layers = range(0)  # the decoder layers this stage holds


class _Stub(nn.Module):
    """A decoder layer another stage holds: entry (yields what arrived), exit (stops), or passthrough."""

    def __init__(self, kind: str, state: StageState, attention_type: str):
        super().__init__()
        self.kind, self.state, self.attention_type = kind, state, attention_type

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.state.head_mode:
            return hidden_states
        if self.kind == "entry":
            return self.state.received
        if self.kind == "exit":
            raise StageDone(hidden_states)
        return hidden_states


class _Gated(nn.Module):
    """Rank 0's own layers: skipped while rank 0 runs only the head on the last stage's output."""

    def __init__(self, layer: nn.Module, state: StageState):
        super().__init__()
        self.layer, self.state = layer, state
        self.attention_type = getattr(layer, "attention_type", "full_attention")

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return hidden_states if self.state.head_mode else self.layer(hidden_states, *args, **kwargs)


class _Head(nn.Module):
    """lm_head: on the last stage (not rank 0) it stops with its input rows; on rank 0's head pass it
    projects the rows the last stage sent instead of its own input."""

    def __init__(self, lm_head: nn.Module, state: StageState, last_stage: bool):
        super().__init__()
        self.lm_head, self.state, self.last_stage = lm_head, state, last_stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.last_stage:
            raise StageDone(x)
        if self.state.head_mode:
            x = self.state.received
        return self.lm_head(x)


def cut_stage(model, stage: int, num_stages: int, state: StageState) -> range:
    """Keep this stage's layers in `model` (others become stubs); returns the layer range kept."""
    layers = model.model.layers
    mine = split_evenly(len(layers), num_stages)[stage]
    new = []
    for i, layer in enumerate(layers):
        kind = getattr(layer, "attention_type", "full_attention")
        if i in mine:
            new.append(_Gated(layer, state) if stage == 0 else layer)
        elif i == 0:
            new.append(_Stub("entry", state, kind))
        elif i == mine.stop:
            new.append(_Stub("exit", state, kind))
        else:
            new.append(_Stub("pass", state, kind))
    model.model.layers = nn.ModuleList(new)
    state.layers = mine
    if stage == 0 or stage == num_stages - 1:
        model.lm_head = _Head(model.lm_head, state, last_stage=stage == num_stages - 1 and stage != 0)
    return mine
