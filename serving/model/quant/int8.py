"""gpt-fast-style weight-only int8: int8 weights with one fp32 scale per output channel.

On CPU the decode path (a few rows at a time) is bandwidth-bound, so reading int8 instead of fp32
weights is what makes it faster. quantgate's kernels serve every batch size on CPU, reading the int8
weight once per call (serving/model/quant/kernel_path.py picks one: serving/kernels/cpu/wo_bf16 for bf16 activations on
AVX-512-BF16 CPUs, serving/kernels/cpu/wo_fp32 for fp32 activations on every x86 CPU). Where neither runs,
torch's: `torch._weight_int8pack_mm` for a few rows (fast with bf16 activations only), and wider inputs
dequantized into a matmul, in bf16 only where the CPU multiplies bf16 natively.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import wo_bf16, wo_fp32
from serving.model.quant.kernel_path import KernelCall, KernelPath, bf16_op, wide_compute_dtype
from serving.model.quant.weight_only import WeightOnlyLinear

# Up to this many rows torch's int8 kernel (a GEMV per row, bf16 activations) beats dequantize-then-matmul:
# its cost grows with the rows, the matmul's barely (the crossover: docs/results/design-figures.md).
FAST_PATH_MAX_ROWS = 8


class Int8WeightOnlyLinear(WeightOnlyLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("_unit_scales", torch.ones(out_features, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("_woq_weight", None, persistent=False)  # serving/kernels/cpu/wo_bf16's layout
        self.register_buffer("_wo_weight", None, persistent=False)  # serving/kernels/cpu/wo_fp32's layout
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.isa = isas.resolve()  # the kernel path in force when the layer was built
        self._path: KernelPath | None = None
        self._call: KernelCall | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        weight = linear.weight.detach().float()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        module.weight_int8, module.scales = quantize_per_channel(weight)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module.to(linear.weight.device)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.plain_weight().to(dtype) * self.scales.to(dtype)[:, None]

    def plain_weight(self) -> torch.Tensor:
        if self.weight_int8.numel():
            return self.weight_int8
        return wo_bf16.unpack_int8(self._woq_weight) if self._woq_weight is not None else wo_fp32.untile(self._wo_weight)

    # ---- the format's part of WeightOnlyLinear --------------------------------------------------------

    def _device(self) -> torch.device:
        return self.weight_int8.device

    def _fits(self) -> tuple[bool, bool]:
        k, n = self.in_features, self.out_features
        return wo_bf16.fits(k, n), wo_fp32.fits(k, n)

    def _pack(self, path: KernelPath) -> None:
        if path.kind == "wo_bf16":
            self._woq_weight = wo_bf16.pack_int8(self.weight_int8, isa=path.isa)
        elif path.kind == "wo_fp32":
            self._wo_weight = wo_fp32.tile(self.weight_int8)

    def kernel_layout(self) -> torch.Tensor | None:
        return self._woq_weight if self._woq_weight is not None else self._wo_weight

    def _kernel_fields(self, path: KernelPath) -> tuple[tuple[str, int], ...]:
        return ("_woq_weight" if path.kind == "wo_bf16" else "_wo_weight", 0), ("scales", 0)

    def _kernel_call(self, path: KernelPath, tensors: tuple[torch.Tensor, ...]) -> KernelCall:
        if path.kind == "wo_bf16":
            return KernelCall(bf16_op(path.isa, "int8"), tensors, (), True)
        return KernelCall(wo_fp32._op(path.isa, "linear_int8"), tensors, (), False)

    def _torch_linear(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type == "cpu" and rows.shape[0] <= FAST_PATH_MAX_ROWS and rows.dtype == torch.bfloat16:
            # bf16 in, bf16 out: the scales may as well be applied in the kernel (rounding a scale to bf16
            # is an error the size of the output's own rounding); one op, no float32 temporaries
            return torch._weight_int8pack_mm(rows, self.weight_int8, self.scales.to(torch.bfloat16))
        if rows.device.type == "cpu" and rows.shape[0] <= FAST_PATH_MAX_ROWS:
            y = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.weight_int8, self._unit_scales.to(torch.bfloat16))
            return (y.to(torch.float32) * self.scales).to(rows.dtype)
        compute = wide_compute_dtype(rows.dtype, rows.device)
        y = F.linear(rows.to(compute), self.plain_weight().to(compute)).to(torch.float32) * self.scales
        return y.to(rows.dtype)

    def drop_plain(self) -> None:
        """Serve from the kernel layout alone (a loaded variant is never saved again): half the bytes."""
        if self._own_kernel():
            self.weight_int8 = torch.empty(0, dtype=torch.int8)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row, the layout of a quantized lm_head,
    so a tied lm_head and embedding share one int8 tensor."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.register_buffer("weight_int8", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(num_embeddings, dtype=torch.float32))
        self.register_buffer("_packed", None, persistent=False)  # the tied lm_head's kernel layout
        self._layout = "wo_bf16"

    def read_packed(self, packed: torch.Tensor, layout: str = "wo_bf16") -> None:
        """Look rows up in the tied lm_head's kernel layout (`layout`: "wo_bf16" or "wo_fp32") and free the plain
        table (never saved again)."""
        self._packed, self._layout = packed, layout
        self.weight_int8 = torch.empty(0, dtype=torch.int8)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> Int8Embedding:
        module = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.weight.dtype)
        module.weight_int8, module.scales = quantize_per_channel(embedding.weight.detach().float())
        return module.to(embedding.weight.device)

    @classmethod
    def sharing(cls, linear: Int8WeightOnlyLinear, dtype: torch.dtype) -> Int8Embedding:
        module = cls(linear.out_features, linear.in_features, dtype)
        module.weight_int8, module.scales = linear.weight_int8, linear.scales
        return module

    @property
    def weight(self) -> torch.Tensor:
        """The shape and dtype of the table this stands for (callers read `.weight.shape`/`.dtype` of
        input embeddings); a meta tensor, so nothing is dequantized. The values are weight_int8 * scales."""
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.dtype, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            codes = F.embedding(ids, self.weight_int8)
        else:
            codes = wo_bf16.packed_rows(self._packed, ids) if self._layout == "wo_bf16" else wo_fp32.tiled_rows(self._packed, ids)
        return (codes.to(torch.float32) * self.scales[ids].unsqueeze(-1)).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: w ≈ q * scale, q in [-127, 127]."""
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(torch.float32)


def replace_linears(
    model: nn.Module, from_weights: bool, skip: Iterable[str] = (), only: Iterable[str] | None = None,
    group_size: int | None = None,
) -> list[str]:
    """Swap nn.Linear modules for Int8WeightOnlyLinear (or, with a `group_size`, Int4WeightOnlyLinear);
    returns the swapped names.

    `skip` holds full or last-part names to leave alone; `only`, when given, the exact names to swap.
    With `from_weights` the existing weights are quantized; otherwise empty modules are created to be
    filled by `load_state_dict`.
    """
    from serving.model.quant.int4 import Int4WeightOnlyLinear

    skip, only = set(skip), None if only is None else set(only)
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name in skip or name.split(".")[-1] in skip:
            continue
        if only is not None and name not in only:
            continue
        if group_size is not None and only is None and not int4_fits(module, group_size):
            continue  # the int4 kernel needs whole groups and 16 output rows at a time: stays as it is
        if group_size is not None and from_weights:
            new = Int4WeightOnlyLinear.from_linear(module, group_size)
        elif group_size is not None:
            new = Int4WeightOnlyLinear(module.in_features, module.out_features, module.bias is not None,
                                       module.weight.dtype, group_size).to(module.weight.device)
        elif from_weights:
            new = Int8WeightOnlyLinear.from_linear(module)
        else:
            new = Int8WeightOnlyLinear(module.in_features, module.out_features, module.bias is not None,
                                       module.weight.dtype).to(module.weight.device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        swapped.append(name)
    return swapped


def quantize_model(model: nn.Module, quantize_lm_head: bool = True, quantize_embeddings: bool = True,
                   group_size: int | None = None) -> list[str]:
    """Quantize a HF causal LM in place (int8, or int4 groups with `group_size`); returns the names of
    the quantized modules. A tied embedding is quantized together with the lm_head into one shared table.
    """
    from serving.model.quant.int4 import Int4Embedding, Int4WeightOnlyLinear

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and isinstance(embed, nn.Embedding) and head.weight is embed.weight
    skip = set() if quantize_lm_head else {_module_name(model, head)} - {None}
    swapped = replace_linears(model, from_weights=True, skip=skip, group_size=group_size)
    fits = group_size is None or embed.weight.shape[1] % group_size == 0
    if quantize_embeddings and isinstance(embed, nn.Embedding) and fits:
        new_head = model.get_output_embeddings()
        if tied and isinstance(new_head, Int8WeightOnlyLinear | Int4WeightOnlyLinear):
            new_embed = type_of_embedding(new_head).sharing(new_head, embed.weight.dtype)
        elif group_size is not None:
            new_embed = Int4Embedding.from_embedding(embed, group_size)
        else:
            new_embed = Int8Embedding.from_embedding(embed)
        name = _module_name(model, embed)
        model.set_input_embeddings(keep_embedding_scale(embed, new_embed))
        swapped.append(name)
    return swapped


def keep_embedding_scale(old: nn.Module, new: nn.Module) -> nn.Module:
    """A quantized table in place of an embedding that scales its rows (Gemma's `embed_scale`, sqrt(hidden)):
    the new module scales them too (a non-persistent buffer, rebuilt from the config on load)."""
    scale = getattr(old, "embed_scale", None)
    if isinstance(scale, torch.Tensor):
        new.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        new.register_forward_hook(_scale_rows)
    return new


def _scale_rows(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * module.embed_scale.to(out.dtype)


def int4_fits(linear: nn.Linear, group_size: int) -> bool:
    from serving.model.quant.int4 import KERNEL_ROWS

    return linear.in_features % group_size == 0 and linear.out_features % KERNEL_ROWS == 0


def type_of_embedding(linear: nn.Module) -> type[nn.Module]:
    from serving.model.quant.int4 import Int4Embedding, Int4WeightOnlyLinear

    return Int4Embedding if isinstance(linear, Int4WeightOnlyLinear) else Int8Embedding


def _module_name(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((name for name, module in model.named_modules() if module is target), None)
