"""quantgate's weight-only int8/int4 linear for CPUs with AVX-512-BF16 (wo_bf16.cpp), bf16 activations.

The kernel reads each weight once per call whatever the batch (torch's CPU int8/int4 kernels redo the
dequantization per row): int8 through a bf16 panel per 48 output channels held in L2, int4 through a
register lookup table (a panel too from 8 rows), a packed bf16 weight in place. It is built twice: for the
`amx` path with AMX tiles (the panel paths multiply on AMX-BF16 over the same layouts, wo_bf16_amx.h, and int8
weights packed in quads run on AMX-INT8 at every row count, wo_bf16_amx_int8.h), and for `avx512bf16` without
them (dpbf16 only), each under its own op namespace, so both run side by side on an AMX CPU.
`available(isa)` says whether a path's build runs here: a CPU with its flags, a compiler, and
`QUANTGATE_WOQ_KERNEL` not "0". The pack functions build its layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from quantgate import settings
from serving.kernels.cpu import build
from serving.kernels.cpu import isa as isas

SOURCE = Path(__file__).with_name("wo_bf16.cpp")
TILE = 16


def cpu_has_avx512_bf16() -> bool:
    return "avx512bf16" in isas.supported()


def cpu_has_amx() -> bool:
    return "amx" in isas.supported()


def _path(isa: str | None) -> str:
    """`isa` resolved; a CPU path below the bf16 ones (or torch) has no build of this kernel."""
    path = isas.resolve(isa)
    return path if path in isas.BF16_PATHS else ""


@cache
def _ops(path: str):
    namespace = f"quantgate_woq_{path}"
    cflags = build.CFLAGS + (isas.NO_AMX_CFLAGS if path == "avx512bf16" else []) + [f"-DQG_NAMESPACE={namespace}"]
    if not build.load(SOURCE, cflags, name=f"woq_linear_{path}"):
        return None
    ops = getattr(torch.ops, namespace)
    return ops if hasattr(ops, "woq_linear_int8") else None


def ops(isa: str | None = None):
    """The op namespace of path `isa`'s build (None: the path in force), or None where it cannot run."""
    path = _path(isa)
    if not path or not settings.enabled(settings.WOQ_KERNEL):
        return None
    return _ops(path)


def available(device: torch.device | str = "cpu", isa: str | None = None) -> bool:
    return torch.device(device).type == "cpu" and ops(isa) is not None


@dataclass(frozen=True)
class _Linears:
    """One build's linear ops as overloads: a decode step makes hundreds of calls, each resolved once here."""
    int8: object
    int4: object
    bf16: object
    bf16_silu: object  # silu(gate) * up over a gate_up weight (the MLP's first half in one call)
    int8_silu: object
    int4_silu: object


_linears: dict[str | None, _Linears] = {}


def _kernel(isa: str | None) -> _Linears:
    found = _linears.get(isa) if isa is not None else None
    if found is None:
        kernel = ops(isa)
        if kernel is None:
            raise RuntimeError(f"quantgate's bf16 kernel does not run on path {isas.resolve(isa)} here")
        found = _Linears(kernel.woq_linear_int8.default, kernel.woq_linear_int4.default,
                         kernel.woq_linear_bf16.default, kernel.woq_linear_bf16_silu.default,
                         kernel.woq_linear_int8_silu.default, kernel.woq_linear_int4_silu.default)
        if isa is not None:
            _linears[isa] = found
    return found


def fits(in_features: int, out_features: int, group_size: int | None = None) -> bool:
    """The kernel's shape rules: N a multiple of 16, K even (int8) or int4 groups a multiple of 8."""
    if group_size is not None:
        return out_features % TILE == 0 and group_size % 8 == 0 and in_features % group_size == 0
    return in_features % 2 == 0 and out_features % TILE == 0


def panel_rows_from(int4: bool, in_features: int, isa: str | None = None) -> int:
    """Calls with fewer rows take the exact int16 paths (every call on Intel CPUs without AMX; where AMX
    takes the call 8 rows for int4 and 24 for int8, as on AMD), from there the bf16 panel."""
    return int(ops(isa).panel_rows_from(int4, in_features))


def int4_exact_rows_below(in_features: int, isa: str | None = None) -> int:
    """int4 calls with fewer rows multiply the exact weight ((q - 8) * scale + zero: the int16 rows, and without
    AMX the raw codes' panel up to 48 rows); from there the weight rounded once to bf16 (Int4Panel)."""
    return int(ops(isa).int4_exact_rows_below(in_features))


def int8_width(in_features: int, isa: str | None = None) -> int:
    """Inputs per channel an int8 weight is packed with for path `isa`: 4 (quads) where the AMX-INT8 path
    runs it, else 2 (pairs)."""
    kernel = ops(isa)
    return 4 if kernel is not None and kernel.amx_int8_ready(in_features) else 2


def pack_int8(weight: torch.Tensor, width: int | None = None, isa: str | None = None) -> torch.Tensor:
    """[N, K] int8 -> [N/16, K/width, 16, width]: 16 channels at `width` consecutive inputs per row, pairs
    for the dpbf16 and int16 paths, quads for AMX-INT8 (default: `int8_width(K, isa)`)."""
    n, k = weight.shape
    width = width or int8_width(k, isa)
    return weight.view(n // TILE, TILE, k // width, width).permute(0, 2, 1, 3).contiguous()


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> [N/16, K/2, 16, 2]: the pairs dpbf16 and AMX-BF16 read in place."""
    return pack_int8(weight, 2)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the [N, K] weight behind a `pack_int8`/`pack_bf16` layout: an embedding lookup."""
    flat = ids.reshape(-1)
    return packed[flat // TILE, :, flat % TILE, :].reshape(*ids.shape, packed.shape[1] * packed.shape[3])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 -> [N/16, K/8, 32] int16 words, four codes each: channel c, input
    8j + 2i + parity in nibble i of lane 2c + parity of word j. The kernel reads the layer's own
    [K/g, N, 2] bf16 scales and zeros."""
    n, k = q.shape
    if n > PACK_ROWS:  # tiles of 16 rows are independent: a block at a time, not ~18 bytes per code at once
        return torch.cat([pack_int4(q[i:i + PACK_ROWS]) for i in range(0, n, PACK_ROWS)])
    nibbles = q.to(torch.int32).view(n // TILE, TILE, k // 8, 4, 2).permute(0, 2, 1, 4, 3)
    words = (nibbles << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1)
    words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    return words.reshape(n // TILE, k // 8, 2 * TILE).contiguous()


PACK_ROWS = 4096  # a multiple of TILE


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """[..., ] int16 words -> [..., 4] their codes, nibble i last."""
    return ((words.to(torch.int32) & 0xFFFF).unsqueeze(-1) >> torch.tensor([0, 4, 8, 12], dtype=torch.int32)) & 0xF


def unpack_int4(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `pack_int4`'s codes: [N, K] uint8 in 0..15."""
    nibbles = _nibbles(words.view(n // TILE, k // 8, TILE, 2))  # [T, j, c, parity, i]
    return nibbles.permute(0, 2, 1, 4, 3).reshape(n, k).to(torch.uint8)


def int4_rows(words: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Codes [len(ids), K] (0..15) of rows `ids` behind a `pack_int4` layout: an embedding lookup."""
    flat = ids.reshape(-1)
    tile, channel = flat // TILE, flat % TILE
    lanes = torch.stack([2 * channel, 2 * channel + 1], dim=-1)  # [n, parity]
    picked = torch.gather(words[tile], 2, lanes[:, None, :].expand(-1, words.shape[1], 2))  # [n, K/8, parity]
    return _nibbles(picked).transpose(2, 3).reshape(flat.numel(), words.shape[1] * 8).to(torch.uint8)  # k = 8j + 2i + parity


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int8`: [N, K] int8."""
    tiles, groups, _, width = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE, groups * width)


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels write fp32 or bf16; other dtypes get fp32 and are cast by the caller."""
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype,
                isa: str | None = None) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) -> [M, N] in out_dtype: x @ (q * scales)^T."""
    return _kernel(isa).int8(x, packed, scales, out_dtype)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_dtype: torch.dtype, isa: str | None = None) -> torch.Tensor:
    return _kernel(isa).bf16(x, packed, out_dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, n: int,
                out_dtype: torch.dtype, isa: str | None = None) -> torch.Tensor:
    return _kernel(isa).int4(x, packed, scales_zeros, group_size, n, out_dtype)
