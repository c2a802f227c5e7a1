"""gpt-fast-style weight-only int4: 4-bit codes in groups along the input, a bf16 scale and zero each.

w ≈ (q - 8) * scale + zero, q in [0, 15], per group of `group_size` inputs of one output row (the
semantics of `torch._weight_int4pack_mm_for_cpu`). Decode reads a quarter of the bf16 bytes, which
is what makes it faster. The codes are kept plain on disk (two per byte, low nibble first); on CPU
they are repacked at load into a kernel's own layout, which then serves alone: one of quantgate's kernels
at every batch size where one runs (serving/model/quant/kernel_path.py: AVX-512-BF16 for bf16 activations, every x86
CPU for fp32 ones), else torch's, with wide inputs (prefill, big decode batches), where torch's falls behind
a GEMM, dequantized and run as a GEMM; other devices always do that.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import wo_bf16, wo_fp32
from serving.model.quant.kernel_path import KernelCall, KernelPath, bf16_op, wide_compute_dtype
from serving.model.quant.weight_only import WeightOnlyLinear

# Smaller groups keep the logits closer to the source's (docs/results/design-figures.md).
DEFAULT_GROUP_SIZE = 32
# Up to this many rows the int4 kernel beats dequantize-then-GEMM on CPU: it costs ~linear in rows, the
# GEMM barely (the crossover: docs/results/design-figures.md).
FAST_PATH_MAX_ROWS = 128
KERNEL_ROWS = 64  # the CPU kernel packs 64 output rows at a time: [N/64, K, 32] bytes, rows 0-31 low nibbles


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group: plain codes [N, K/2] uint8 and scales_and_zeros [K/g, N, 2] bf16
    (the dtype the CPU kernel reads them in)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return pack_nibbles(q), scales_and_zeros


def check_group_size(model: nn.Module, group_size: int, quantize_lm_head: bool = True,
                     quantize_embeddings: bool = True) -> None:
    """Refuse a group size that does not divide the input width of every layer int4 would quantize: those
    layers would otherwise be left unquantized without a word."""
    head = model.get_output_embeddings()
    widths = {name: m.in_features for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and (quantize_lm_head or m is not head)}
    embed = model.get_input_embeddings()
    if quantize_embeddings and isinstance(embed, nn.Embedding):
        widths["input embeddings"] = embed.embedding_dim
    bad = {name: width for name, width in widths.items() if width % group_size}
    if bad:
        dividing = [g for g in (32, 64, 128, 256) if all(w % g == 0 for w in widths.values())]
        raise ValueError(
            f"int4 group size {group_size} does not divide the input width of {len(bad)} of the {len(widths)} "
            f"layers to quantize (widths {sorted(set(bad.values()))}, e.g. {next(iter(bad))}); they would stay "
            f"unquantized. Group sizes that divide every layer: {dividing or 'none of 32, 64, 128, 256'}"
        )


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, ::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 in 0..15."""
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)


def dequantize_rows(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """codes [R, K/2] with their [K/g, R, 2] scales and zeros -> weights [R, K] in `dtype`."""
    return _dequantize(unpack_nibbles(codes), scales_and_zeros, group_size, dtype)


def _dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    r, k = q.shape
    sz = scales_and_zeros.to(dtype).transpose(0, 1)  # [R, K/g, 2]
    w = (q.view(r, k // group_size, group_size).to(dtype) - 8) * sz[..., :1] + sz[..., 1:]
    return w.view(r, k)


PACK_ROWS = 4096  # rows packed at a time: torch's packing widens the codes to int32 and copies them twice


def pack_for_cpu(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 -> the CPU kernel's layout. Its blocks of 64 rows are independent, so a tall
    matrix (a 150k-row lm_head) is packed a block of rows at a time: whole, it peaked at ~18 bytes/weight."""
    n = q.shape[0]
    if n <= PACK_ROWS or n % KERNEL_ROWS or not cpu_layout_known():
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i:i + PACK_ROWS].int(), 1)
                      for i in range(0, n, PACK_ROWS)])


def unpack_cpu_layout(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_for_cpu` for N a multiple of 64 (checked once per process by `cpu_layout_known`)."""
    blocks = packed.view(n // KERNEL_ROWS, k, KERNEL_ROWS // 2)
    q = torch.cat([blocks & 0xF, blocks >> 4], dim=-1)  # [N/64, K, 64]
    return q.transpose(1, 2).reshape(n, k)


@lru_cache(maxsize=1)
def cpu_layout_known() -> bool:
    """This torch packs as `unpack_cpu_layout` expects (the layout is the kernel's, not an API)."""
    q = torch.randint(0, 16, (128, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    return torch.equal(unpack_cpu_layout(pack_for_cpu(q), 128, 256).int(), q)


class Int4WeightOnlyLinear(WeightOnlyLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32,
                 group_size: int = DEFAULT_GROUP_SIZE):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("codes", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros",
                             torch.zeros(in_features // group_size, out_features, 2, dtype=torch.bfloat16))
        self.register_buffer("_packed", None, persistent=False)  # torch's kernel layout
        self.register_buffer("_woq_codes", None, persistent=False)  # serving/kernels/cpu/wo_bf16's layout
        self.register_buffer("_wo_codes", None, persistent=False)  # serving/kernels/cpu/wo_fp32's layout
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.isa = isas.resolve()  # the kernel path in force when the layer was built
        self._path: KernelPath | None = None
        self._call: KernelCall | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> Int4WeightOnlyLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                     group_size)
        module.codes, module.scales_and_zeros = quantize_groups(linear.weight.detach(), group_size)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module.to(linear.weight.device)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.codes.numel():
            return dequantize_rows(self.codes, self.scales_and_zeros, self.group_size, dtype)
        if self._woq_codes is not None:
            q = wo_bf16.unpack_int4(self._woq_codes, self.out_features, self.in_features)
        elif self._wo_codes is not None:
            q = unpack_nibbles(wo_fp32.untile(self._wo_codes))
        else:
            q = unpack_cpu_layout(self._packed, self.out_features, self.in_features)
        return _dequantize(q, self.scales_and_zeros, self.group_size, dtype)

    def _kernel_weights(self) -> torch.Tensor:
        if self._packed is None:  # repacked once, on first use: the layout is the CPU kernel's own
            self._packed = pack_for_cpu(unpack_nibbles(self.codes))
            self._scales_bf16 = self.scales_and_zeros.to(torch.bfloat16)
        return self._packed

    # ---- the format's part of WeightOnlyLinear --------------------------------------------------------

    def _device(self) -> torch.device:
        return self.codes.device

    def _fits(self) -> tuple[bool, bool]:
        k, n, g = self.in_features, self.out_features, self.group_size
        return wo_bf16.fits(k, n, g), wo_fp32.fits(k, n, g)

    def _pack(self, path: KernelPath) -> None:
        if path.kind == "wo_bf16":  # a block of rows at a time: a 150k-row lm_head unpacked whole is 2 bytes/code
            self._woq_codes = torch.cat([wo_bf16.pack_int4(unpack_nibbles(self.codes[i:i + PACK_ROWS]))
                                         for i in range(0, self.out_features, PACK_ROWS)])
        elif path.kind == "wo_fp32":
            self._wo_codes = wo_fp32.tile(self.codes)

    def _kernel_fields(self, path: KernelPath) -> tuple[tuple[str, int], ...]:
        return ("_woq_codes" if path.kind == "wo_bf16" else "_wo_codes", 0), ("scales_and_zeros", 1)

    def _kernel_tensors(self, path: KernelPath) -> tuple[torch.Tensor, ...]:
        codes, _ = super()._kernel_tensors(path)
        return codes, self._scales_for_kernel()  # bf16 and contiguous, as the kernels read them

    def _kernel_call(self, path: KernelPath, tensors: tuple[torch.Tensor, ...]) -> KernelCall:
        if path.kind == "wo_bf16":  # its output width: the scales' [K/g, N, 2]
            return KernelCall(bf16_op(path.isa, "int4"), tensors, (self.group_size, tensors[1].shape[1]), True)
        return KernelCall(wo_fp32._op(path.isa, "linear_int4"), tensors, (self.group_size,), False)

    def _torch_linear(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type == "cpu" and rows.shape[0] <= FAST_PATH_MAX_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self._kernel_weights(),
                                                           self.group_size, self._scales_bf16)
            return y.to(rows.dtype)
        compute = wide_compute_dtype(rows.dtype, rows.device)
        return F.linear(rows.to(compute), self.dequantized_weight(compute)).to(rows.dtype)

    def kernel_layout(self) -> torch.Tensor | None:
        return self._woq_codes if self._woq_codes is not None else self._wo_codes

    def _scales_for_kernel(self) -> torch.Tensor:
        sz = self.scales_and_zeros  # bf16 as stored, unless the model was cast: then converted once
        if sz.dtype == torch.bfloat16 and sz.is_contiguous():
            return sz
        if getattr(self, "_scales_cast", None) is None or self._scales_cast.shape != sz.shape:
            self._scales_cast = sz.to(torch.bfloat16).contiguous()
        return self._scales_cast

    def drop_codes(self) -> None:
        """Serve from a kernel layout alone (a loaded variant is never saved again): half the bytes."""
        if self.codes.device.type != "cpu":
            return
        if self._own_kernel() or (self.out_features % KERNEL_ROWS == 0 and cpu_layout_known()):
            if self.kernel_layout() is None:
                self._kernel_weights()
            self.codes = torch.empty(0, dtype=torch.uint8)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class Int4Embedding(nn.Module):
    """An embedding table as int4 groups; a tied lm_head and embedding share the same codes."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 group_size: int = DEFAULT_GROUP_SIZE):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.group_size = group_size
        self.register_buffer("codes", torch.zeros(num_embeddings, embedding_dim // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros",
                             torch.zeros(embedding_dim // group_size, num_embeddings, 2, dtype=torch.bfloat16))
        self.register_buffer("_words", None, persistent=False)  # the tied lm_head's kernel layout
        self._layout = "wo_bf16"

    def read_packed(self, words: torch.Tensor, layout: str = "wo_bf16") -> None:
        """Look rows up in the tied lm_head's kernel layout (`layout`: "wo_bf16" or "wo_fp32") and free the plain
        codes (never saved again)."""
        self._words, self._layout = words, layout
        self.codes = torch.empty(0, dtype=torch.uint8)

    @classmethod
    def sharing(cls, linear: Int4WeightOnlyLinear, dtype: torch.dtype) -> Int4Embedding:
        module = cls(linear.out_features, linear.in_features, dtype, linear.group_size)
        module.codes, module.scales_and_zeros = linear.codes, linear.scales_and_zeros
        return module

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Embedding:
        module = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.weight.dtype, group_size)
        module.codes, module.scales_and_zeros = quantize_groups(embedding.weight.detach(), group_size)
        return module

    @property
    def weight(self) -> torch.Tensor:
        """Shape and dtype of the table this stands for, on the meta device: nothing is dequantized."""
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.dtype, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self._words is None:
            q = unpack_nibbles(self.codes[flat])
        elif self._layout == "wo_bf16":
            q = wo_bf16.int4_rows(self._words, flat)
        else:
            q = unpack_nibbles(wo_fp32.tiled_rows(self._words, flat))
        rows = _dequantize(q, self.scales_and_zeros[:, flat], self.group_size, self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}, dtype={self.dtype}"
