"""Linear layers whose weights are packed once at load (CPU, bfloat16): for quantgate's kernel or oneDNN.

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which it re-lays out into its
blocked format on every call: at decode sizes (a few rows) that reordering reads and writes the whole
weight again, so a memory-bound step moves it twice. Packing once at load time removes that (results
bit-identical to `F.linear`; figures: docs/results/design-figures.md). This is what IPEX and inductor's CPU
freezing do; we do it on the unmodified model by swapping `nn.Linear` modules, so quantized layers (ours,
bitsandbytes) are untouched.

Where quantgate's own kernel runs (serving/kernels/cpu/wo_bf16, AVX-512-BF16) it replaces oneDNN for every bf16
projection: the weight is re-laid out once as bf16 pairs that `woq_linear_bf16` reads in place, which
beats oneDNN's packed kernel most at decode sizes (`quantgate bench woq`; docs/results/design-figures.md).
A tied lm_head shares its weight with the embedding, and oneDNN's packed tensor is opaque (no rows to
look up); the pair layout has rows, so the embedding indexes the head's copy: one copy.

On CPUs without native bf16 (AVX2-only, AVX-512 without BF16) a bf16 model is stored in bf16 and computed
in fp32: `WoLinear` holds each weight tiled for serving/kernels/cpu/wo_fp32, which widens it in registers
(half the bytes of fp32; never torch's bf16 matmul, a scalar loop there, nor oneDNN's packing, which
refuses bf16 on AVX2). An fp32 model there (their default dtype) is tiled the same way: torch's fp32 matmul
is MKL's sgemm, which streamed a decode step's weights at 6-11 GB/s on an AMD EPYC where wo_fp32 reads them
at 26-42 GB/s (docs/results/2026-12-07-amd-epyc-zen4-fp32.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from quantgate import settings
from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import wo_bf16, wo_fp32

WO_DTYPES = (torch.bfloat16, torch.float32)  # the weights `WoLinear` tiles as they are
ONEDNN_BF16_FLAGS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))


def onednn_bf16() -> bool:
    """oneDNN packs bf16 weights on this CPU (it raises on plain AVX2)."""
    flags = isas.cpu_flags()
    return torch.backends.mkldnn.is_available() and any(need <= flags for need in ONEDNN_BF16_FLAGS)


def packing_wanted(device: torch.device, dtype: torch.dtype, isa: str | None = None) -> bool:
    if not settings.enabled(settings.PACK_WEIGHTS) or device.type != "cpu":
        return False
    if isas.resolve(isa) in wo_fp32.PATHS:
        return dtype in WO_DTYPES
    return dtype == torch.bfloat16 and onednn_bf16()


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight held as an opaque oneDNN tensor (a non-persistent buffer, so
    `resident_bytes` still counts it and nothing is written to checkpoints)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None),
                             persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PairPackedLinear(nn.Module):
    """A bf16 `nn.Linear` over the pair layout quantgate's kernel reads in place (a tied lm_head shares
    it with `PairPackedEmbedding`)."""

    def __init__(self, packed: torch.Tensor, isa: str, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0] * wo_bf16.TILE, packed.shape[1] * 2
        self.isa = isa  # amx or avx512bf16: which build of the kernel runs it
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear, isa: str) -> PairPackedLinear:
        return cls(wo_bf16.pack_bf16(linear.weight.detach()), isa, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16 and self.bias is None:  # the decoder's rows: no reshapes
            return wo_bf16.bf16_linear(x.contiguous(), self.packed_weight, torch.bfloat16, self.isa)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = wo_bf16.bf16_linear(flat, self.packed_weight, wo_bf16.out_dtype(x.dtype), self.isa)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class WoLinear(nn.Module):
    """A bf16 or fp32 `nn.Linear` over the tiled layout serving/kernels/cpu/wo_fp32 widens in registers
    (fp32 math on every x86 CPU); a tied lm_head shares it with `WoEmbedding`."""

    def __init__(self, packed: torch.Tensor, isa: str, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0] * wo_fp32.TILE, packed.shape[1]
        self.isa = isa
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def of(cls, linear: nn.Linear, isa: str) -> WoLinear:
        return cls(wo_fp32.tile(linear.weight.detach()), isa, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed_weight.dtype == torch.float32:
            y = wo_fp32.linear_f32(self.isa, flat, self.packed_weight)
        else:
            y = wo_fp32.linear_bf16(self.isa, flat, self.packed_weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, isa={self.isa}"


class WoEmbedding(nn.Module):
    def __init__(self, head: WoLinear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.register_buffer("packed_weight", head.packed_weight, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.packed_weight.dtype, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return wo_fp32.tiled_rows(self.packed_weight, ids)


def pack_for_wo(model: nn.Module, isa: str) -> int:
    """Swap every plain bf16 or fp32 `nn.Linear` (a tied lm_head with its embedding) for a `WoLinear` on path
    `isa`; returns how many. Shapes the kernel does not take stay plain."""
    if not wo_fp32.available(isa):
        return 0
    swapped = 0
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = type(embed) is nn.Embedding and type(head) is nn.Linear and head.weight is embed.weight
    if tied and head.bias is None and head.weight.dtype in WO_DTYPES and wo_fp32.fits(head.in_features,
                                                                                      head.out_features):
        new_head = WoLinear.of(head, isa)
        model.set_output_embeddings(new_head)
        model.set_input_embeddings(WoEmbedding(new_head))
        swapped += 1
    embed_weight = getattr(embed, "weight", None)
    del embed, head

    def tiled(child: nn.Linear) -> nn.Module | None:
        if child.weight.dtype in WO_DTYPES and child.weight is not embed_weight and wo_fp32.fits(
                child.in_features, child.out_features):
            return WoLinear.of(child, isa)
        return None

    return swapped + swap_linears(model, tiled)


class PairPackedEmbedding(nn.Module):
    def __init__(self, head: PairPackedLinear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.register_buffer("packed_weight", head.packed_weight, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """Shape and dtype of the table (callers read them), on the meta device: nothing is unpacked."""
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.bfloat16, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return wo_bf16.packed_rows(self.packed_weight, ids)


def pack_tied_head(model: nn.Module, isa: str) -> bool:
    """Swap a tied bf16 lm_head and its embedding for one pair-packed weight; False where it cannot."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embed) is not nn.Embedding or type(head) is not nn.Linear or head.weight is not embed.weight:
        return False
    weight = head.weight
    if (weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or head.bias is not None
            or not wo_bf16.fits(weight.shape[1], weight.shape[0]) or not wo_bf16.available(isa=isa)):
        return False
    new_head = PairPackedLinear.of(head, isa)
    model.set_output_embeddings(new_head)
    model.set_input_embeddings(PairPackedEmbedding(new_head))
    return True


def _packed(linear: nn.Linear, own_kernel: bool, isa: str) -> nn.Module:
    if own_kernel and wo_bf16.fits(linear.in_features, linear.out_features):
        return PairPackedLinear.of(linear, isa)
    return PackedLinear(linear)


def pack_linears(model: nn.Module, isa: str | None = None) -> int:
    """Swap every plain bf16 (or, on wo_fp32's paths, fp32) `nn.Linear` for a `WoLinear` (path `isa` is one of
    wo_fp32's: CPUs without native bf16, or forced), a `PairPackedLinear` (where quantgate's bf16 kernel runs) or a `PackedLinear`
    (oneDNN); returns how many. Subclasses (bitsandbytes' Linear8bitLt is one) and other
    dtypes keep their own kernels. A weight shared with another module (tied embeddings and lm_head) stays
    shared: oneDNN packing would hold a second copy, so it is pair-packed for our kernel where that runs
    (`pack_tied_head`, counted here), else left plain."""
    path = isas.resolve(isa)
    if path in wo_fp32.PATHS:
        return pack_for_wo(model, path)
    if not onednn_bf16():
        return 0
    counts: dict[int, int] = {}
    for _, tensor in model.named_parameters(remove_duplicate=False):
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    own_kernel = path in isas.BF16_PATHS and wo_bf16.available(isa=path)
    swapped = int(own_kernel and pack_tied_head(model, path))

    def packed(child: nn.Linear) -> nn.Module | None:
        if child.weight.dtype != torch.bfloat16 or counts.get(id(child.weight), 0) > 1:
            return None
        return _packed(child, own_kernel, path)

    return swapped + swap_linears(model, packed)


def swap_linears(model: nn.Module, replace: Callable[[nn.Linear], nn.Module | None]) -> int:
    """Each plain `nn.Linear` child replaced by `replace(child)` (None: kept), one at a time; returns how many.
    Only the parents are listed, so each old weight is freed as soon as its replacement is in place and the
    next packing reuses its memory (listing the children too kept every old weight alive to the end: 3.0 GB
    over the weights while Qwen2.5-Coder-1.5B's bf16 linears were packed)."""
    parents = [m for m in model.modules() if any(type(c) is nn.Linear for c in m.children())]
    swapped = 0
    for parent in parents:
        for name in [n for n, c in parent.named_children() if type(c) is nn.Linear]:
            new = replace(getattr(parent, name))
            if new is not None:
                setattr(parent, name, new)
                swapped += 1
    return swapped
