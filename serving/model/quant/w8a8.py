"""W8A8: int8 weights (one scale per output channel) and int8 activations (one scale per row, per call).

A weight-only format saves bytes, which is what decode at a few rows is bound by; from ~16 rows a CPU is
compute-bound and a weight-only GEMM multiplies at the bf16 rate whatever its weight's width. With both sides
int8 the products run on the CPU's int8 dot products (VNNI, AMX-INT8: twice the bf16 rate), so prefill and
decode under load get faster too (serving/kernels/cpu/w8a8.cpp; torch's int8 GEMM does the products).

Activations have outlier channels a per-row int8 scale cannot resolve; SmoothQuant (Xiao et al., 2023) moves
part of their range into the weights: input channel c is divided by `smooth[c]` and the weight's column c
multiplied by it, exact in real arithmetic. quantize/w8a8.py chooses `smooth` on calibration text; here the
layer holds w * smooth in int8 and 1 / smooth, applied to the rows in the op's quantization pass (nothing is
folded into other layers, so every architecture takes it). Layers reading one input (q/k/v, gate/up) share
one `smooth`, and their fused call (serving/model/fused_linear.py) is one op.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import w8a8 as kernel
from serving.kernels.cpu import wo_bf16
from serving.model.quant.kernel_path import KernelCall

# The paths whose CPUs run w8a8_vnni.h (where they have AVX-512 VNNI). Not `amx`: there torch's int8 GEMM runs on
# AMX-INT8 tiles (8x VPDPBUSD's products a cycle), which our VNNI loop cannot match at prefill (not measured yet).
VNNI_PATHS = ("avx512bf16", "avx512")


class Int8DynamicLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("inv_smooth", torch.ones(in_features, dtype=torch.float32))
        self.register_buffer("_packed", None, persistent=False)  # [N/16, K/4, 16, 4]: w8a8_vnni.h's quads
        self.register_buffer("_compensation", None, persistent=False)  # 128 * sum_k w[n, k], int32
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.isa = isas.resolve()  # the kernel path in force when the layer was built
        self._kind: str | None = None  # "vnni", "int_mm" (torch's int8 GEMM inside our op) or "torch"
        self._call: KernelCall | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, smooth: torch.Tensor | None = None) -> Int8DynamicLinear:
        """`linear` with its input channels divided by `smooth` (its weight's columns multiplied by it)."""
        from serving.model.quant.int8 import quantize_per_channel

        module = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        weight = linear.weight.detach().float()
        if smooth is not None:
            smooth = smooth.detach().float().to(weight.device)
            weight = weight * smooth[None, :]
            module.inv_smooth = (1.0 / smooth).contiguous()
        module.weight_int8, module.scales = quantize_per_channel(weight)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module.to(linear.weight.device)

    def plain_weight(self) -> torch.Tensor:
        return self.weight_int8 if self.weight_int8.numel() else wo_bf16.unpack_int8(self._packed)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer multiplies by (smoothing undone), for comparisons."""
        w = self.plain_weight().float() * self.scales[:, None] * self.inv_smooth[None, :]
        return w.to(dtype)

    def kernel_kind(self) -> str:
        """Which kernel serves this layer, decided (and the quads packed) once: our VNNI kernel on the AVX-512
        paths of a CPU with AVX-512 VNNI, else our op around torch's int8 GEMM, else torch's ops."""
        if self._kind is None:
            if self.weight_int8.device.type != "cpu" or self.isa == "torch" or kernel.linear_op() is None:
                self._kind = "torch"
            elif (self.isa in VNNI_PATHS and kernel.vnni_ready() and self.out_features % 16 == 0
                  and self.in_features % 4 == 0):
                self._packed = wo_bf16.pack_int8(self.weight_int8, 4)
                self._compensation = 128 * self.weight_int8.to(torch.int32).sum(1, dtype=torch.int32)
                self._kind = "vnni"
            else:
                self._kind = "int_mm"
        return self._kind

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the op reads after the rows, as the layer holds them now."""
        if self.kernel_kind() == "vnni":
            return self._packed, self._compensation, self.scales, self.inv_smooth
        return self.weight_int8, self.scales, self.inv_smooth

    def bf16_rows(self) -> bool:
        """The op takes bf16 rows and an out dtype (wo_bf16's convention): the VNNI kernel on a bf16 path, where
        the engine holds bf16 rows (as int8wo's layers there, an fp32 engine's rows are rounded to bf16 first)."""
        return self.kernel_kind() == "vnni" and self.isa in isas.BF16_PATHS

    def kernel_op(self) -> torch._ops.OpOverload | None:
        kind = self.kernel_kind()
        return None if kind == "torch" else kernel.vnni_op(self.bf16_rows()) if kind == "vnni" else kernel.linear_op()

    def kernel_layout(self) -> torch.Tensor | None:
        """The packed quads a tied embedding may look its rows up in (wo_bf16.packed_rows), where packed."""
        return self._packed if self.kernel_kind() == "vnni" else None

    def drop_plain(self) -> None:
        """Serve from the quads alone (a loaded variant is never saved again): half the bytes."""
        if self.kernel_kind() == "vnni":
            self.weight_int8 = torch.empty(0, dtype=torch.int8)

    def forget_kernel(self) -> None:
        """Drop the packed quads and the compiled call that holds them (a build streaming layers frees each one)."""
        self._packed = self._compensation = self._call = self._kind = None

    def kernel_call(self) -> KernelCall | None:
        """The compiled op over this layer's tensors (None: torch's ops serve, off CPU or without a compiler)."""
        op = self.kernel_op()
        if op is None:
            return None
        tensors = self.kernel_tensors()
        if self._call is None or any(a is not b for a, b in zip(self._call.tensors, tensors, strict=True)):
            self._call = KernelCall(op, tensors, (), self.bf16_rows())
        return self._call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        call = self.kernel_call()
        y = call(rows) if call is not None else reference_linear(rows, self.plain_weight(), self.scales, self.inv_smooth)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_rows(rows: torch.Tensor, inv_smooth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's codes and row scales, in torch: round(x / smooth * 127 / max|x / smooth|) per row."""
    scaled = rows.float() * inv_smooth
    row_scale = scaled.abs().amax(dim=1) / 127.0
    inv = torch.where(row_scale > 0, 1.0 / row_scale, torch.zeros_like(row_scale))
    codes = torch.round(scaled * inv[:, None]).clamp(-127, 127)
    return codes, row_scale


def reference_linear(rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                     inv_smooth: torch.Tensor) -> torch.Tensor:
    """The op's result with torch's ops (another device, no compiler, the tests' reference): integer sums in
    float64, exact at every K a model has."""
    codes, row_scale = quantize_rows(rows, inv_smooth)
    sums = (codes.double() @ weight.double().t()).float()
    return (sums * row_scale[:, None] * scales).to(rows.dtype)
