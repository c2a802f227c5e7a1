"""The W8A8 linear (w8a8.cpp): int8 rows chosen per call times int8 weights.

One build serves every kernel path: the op's own loops (quantizing the rows, scaling the sums) are a pass
each over the rows and outputs; the products run in our VNNI kernel (w8a8_vnni.h, compiled for AVX-512 VNNI
by target attribute, called only where the CPU has it) over the weight packed once in quads, or elsewhere in
`at::_int_mm`, whose oneDNN picks the CPU's int8 instructions (AVX2's VPMADDUBSW, AMX-INT8) at run time.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from serving.kernels.cpu import build
from serving.kernels.cpu import isa as isas

SOURCE = Path(__file__).with_name("w8a8.cpp")


def cflags() -> list[str]:
    """AVX2 where the CPU has it (every x86 family the project meets: the passes are vectorized by hand), else
    the x86-64 baseline. No -march=native (the op serves every path, forced ones included) and no -ffast-math
    (the scalar tail rounds as torch.round by the 1.5 * 2^23 trick, which fast-math would fold away)."""
    return ["-O3", "-fopenmp", *(["-mavx2", "-mfma"] if "avx2" in isas.supported() else [])]


@cache
def ops():
    """`torch.ops.quantgate_w8a8` once built and loaded, else None (no compiler: torch's ops serve)."""
    if not build.load(SOURCE, cflags(), name="w8a8"):
        return None
    return torch.ops.quantgate_w8a8


def linear_op() -> torch._ops.OpOverload | None:
    """Our op around torch's int8 GEMM: any CPU."""
    loaded = ops()
    return None if loaded is None else loaded.linear.default


@cache
def vnni_ready() -> bool:
    """The CPU runs w8a8_vnni.h (AVX-512 F/BW/VL/DQ and VNNI)."""
    loaded = ops()
    return loaded is not None and bool(loaded.vnni_ready())


def vnni_op(bf16_rows: bool = False) -> torch._ops.OpOverload | None:
    """Our VNNI kernel over the weight packed in quads, where the CPU has AVX-512 VNNI; `bf16_rows`: in
    wo_bf16's convention (bf16 rows, the out dtype last), for the bf16 paths."""
    if not vnni_ready():
        return None
    return ops().linear_vnni_bf16.default if bf16_rows else ops().linear_vnni.default
