"""Weight-only linear over fp32 activations, one build per instruction set (wo_fp32.cpp, vec_*.h).

Layers pack their weights once for the path that serves them (`pack_*`: 16 output channels side by side
per input, [N/16, K, 16]; int4 keeps its plain codes re-tiled, [N/16, K/2, 16]) and call `linear_*` with
fp32 rows. `ops(isa)` builds and loads the path's extension on first use (`serving.kernels.cpu.build`), or
returns None where it cannot run (another device, a CPU without the ISA, no compiler).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from serving.kernels.cpu import build
from serving.kernels.cpu import isa as isas

SOURCE = Path(__file__).with_name("wo_fp32.cpp")
TILE = 16
PATHS = ("avx512", "avx2", "scalar")


def cflags(isa: str) -> list[str]:
    return isas.vector_cflags(isa, f"quantgate_wo_{isa}")


# From how many rows (blocks of tiles, whole weight) a call hands its products to torch's fp32 GEMM, where that
# is MKL on a CPU it runs slowly on: MKL's sgemm on AMD (EPYC Zen 4, 2 threads, SmolLM2-135M's projections)
# ran 1.2-2.2x slower than our avx512 panel at 48-1024 rows, and 1.0-1.2x slower than the avx2 panel at
# 128-1024 once that kept its weights in registers (an 8B up_proj: 1.4-1.6x at 128-256)
# (docs/results/2026-12-07-amd-epyc-zen4-fp32.md, ...-fp32-evening.md): there these builds never hand rows over.
# None: the build's defaults (MKL on Intel).
NO_TORCH_GEMM = 1 << 40
PANEL_ONLY_ON_AMD = ("avx512", "avx2")


def torch_gemm_rows(isa: str) -> tuple[int, int] | None:
    if isa not in PANEL_ONLY_ON_AMD or isas.cpu_vendor() != "AuthenticAMD" or not torch.backends.mkl.is_available():
        return None
    return NO_TORCH_GEMM, NO_TORCH_GEMM


@cache
def ops(isa: str):
    """`torch.ops.quantgate_wo_<isa>` once built and loaded, else None."""
    if isa not in PATHS or isa not in isas.supported():
        return None
    if not build.load(SOURCE, cflags(isa), name=f"wo_linear_{isa}"):
        return None
    loaded = getattr(torch.ops, f"quantgate_wo_{isa}")
    if (rows := torch_gemm_rows(isa)) is not None:
        loaded.use_torch_gemm_from(*rows)
    return loaded


def available(isa: str) -> bool:
    return ops(isa) is not None


def fits(in_features: int, out_features: int, group_size: int | None = None) -> bool:
    """Shape rules: N a multiple of 16, K of 4; int4 groups a multiple of 4 dividing K."""
    if out_features % TILE or in_features % 4:
        return False
    return group_size is None or (group_size % 4 == 0 and in_features % group_size == 0)


def tile(weight: torch.Tensor) -> torch.Tensor:
    """[N, K'] (any dtype) -> [N/16, K', 16]: the layout every format shares."""
    n, k = weight.shape
    return weight.view(n // TILE, TILE, k).transpose(1, 2).contiguous()


def untile(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `tile`: [N, K']."""
    tiles, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(tiles * TILE, k)


def tiled_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, K'] weight behind a tiled layout: an embedding lookup, [*ids.shape, K']."""
    flat = ids.reshape(-1)
    return packed[flat // TILE, :, flat % TILE].reshape(*ids.shape, packed.shape[1])


@cache
def _op(isa: str, name: str):
    """The op's overload itself: calling it skips the per-call overload resolution of `torch.ops.ns.name`
    (a decode step makes a hundred-odd of these calls on matrices small enough for that to show)."""
    return getattr(ops(isa), name).default


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()


def linear_f32(isa: str, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] float32."""
    return _op(isa, "linear_f32")(_rows(x), packed)


def linear_bf16(isa: str, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return _op(isa, "linear_bf16")(_rows(x), packed)


def linear_int8(isa: str, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _op(isa, "linear_int8")(_rows(x), packed, scales)


def linear_int4(isa: str, x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    return _op(isa, "linear_int4")(_rows(x), packed, scales_zeros, group_size)
