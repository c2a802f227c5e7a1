"""The base of every weight-only format the engine serves (int8.py, int4.py): where its matmul runs.

A layer's kernel path is chosen once, when the model is loaded (`kernel_path`: from the format's shape rules,
the device and the ISA the layer was built under; quantgate's kernels pack their layout then), and its
forward is one call: the path's `KernelCall` over the layer's packed tensors (serving/kernels/cpu: wo_bf16
for bf16 rows on amx/avx512bf16, wo_fp32 for fp32 rows on every x86 CPU), or, where none of ours runs (another
device, QUANTGATE_ISA=torch, shapes no kernel takes), the format's torch ops. lm_head, biased projections
(Qwen2's q/k/v), the model's own forward and calibration all go through this one forward; the decoder's fused
projections (serving/model/fused_linear.py) build their call with the same `_kernel_call`, over the layers'
`_kernel_fields` joined along the output: the kernel a layer runs is chosen here alone.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.model.quant.kernel_path import KernelCall, KernelPath, choose


class WeightOnlyLinear(nn.Module):
    in_features: int
    out_features: int
    bias: nn.Parameter | None
    isa: str  # the kernel path in force when the layer was built
    _path: KernelPath | None
    _call: KernelCall | None

    # ---- what a format provides ---------------------------------------------------------------------

    def _device(self) -> torch.device:
        raise NotImplementedError

    def _fits(self) -> tuple[bool, bool]:
        """Whether wo_bf16's and wo_fp32's shape rules take this layer."""
        raise NotImplementedError

    def _pack(self, path: KernelPath) -> None:
        """Lay the weight out for `path`'s kernel (once)."""
        raise NotImplementedError

    def _kernel_fields(self, path: KernelPath) -> tuple[tuple[str, int], ...]:
        """The attributes holding the tensors `path`'s kernel reads, in the call's order, each with the dim its
        output channels run along (several layers' tensors joined there are one layer's: fused_linear.py)."""
        raise NotImplementedError

    def _kernel_tensors(self, path: KernelPath) -> tuple[torch.Tensor, ...]:
        """The tensors `path`'s kernel reads, as the layer holds them now (by default its `_kernel_fields`)."""
        return tuple(getattr(self, name) for name, _ in self._kernel_fields(path))

    def _kernel_call(self, path: KernelPath, tensors: tuple[torch.Tensor, ...]) -> KernelCall:
        """The call of `path`'s kernel over `tensors`: this layer's, or several layers' joined along their
        output channels (the output width comes from the tensors, not the layer)."""
        raise NotImplementedError

    def kernel_layout(self) -> torch.Tensor | None:
        raise NotImplementedError

    def _torch_linear(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] -> [M, N] in the rows' dtype with torch's ops (no bias)."""
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------------

    def kernel_path(self) -> KernelPath:
        """The kernel serving this layer, decided (and its layout packed) once."""
        if self._path is None:
            path = choose(self.isa, self._device(), *self._fits())
            self._pack(path)
            self._path = path
        return self._path

    def _own_kernel(self) -> bool:
        """One of quantgate's kernels serves this layer."""
        return self.kernel_path().kind != "torch"

    def kernel_call(self) -> KernelCall | None:
        """This layer's own kernel call (None: torch's ops serve it). Rebuilt only when a tensor it binds was
        replaced since (a fused projection's shared views, a cast), so it never holds a stale copy alive."""
        path = self.kernel_path()
        if path.kind == "torch":
            return None
        tensors, call = self._kernel_tensors(path), self._call
        if call is None or any(a is not b for a, b in zip(call.tensors, tensors, strict=True)):
            self._call = call = self._kernel_call(path, tensors)
        return call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        call = self.kernel_call()
        y = call(rows) if call is not None else self._torch_linear(rows)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias
