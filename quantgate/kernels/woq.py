"""quantgate's weight-only int8/int4 linear for CPUs with AVX-512-BF16 (woq_linear.cpp).

The kernel reads each weight once per call whatever the batch (torch's CPU int8/int4 kernels redo the
dequantization per row): int8 through a bf16 panel per 48 output channels held in L2, int4 through a
register lookup table (a panel too from 8 rows), a packed bf16 weight in place. Where the CPU has AMX,
the panel paths multiply on AMX-BF16 tiles over the same layouts (woq_amx.h), and int8 weights, packed in
quads there, run on AMX-INT8 at every row count (woq_amx_int8.h). `available()` says whether it runs here: a CPU with
avx512_bf16, a compiler, and `QUANTGATE_WOQ_KERNEL` not "0". The pack functions build its layouts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from quantgate import kernels

SOURCE = Path(__file__).with_name("woq_linear.cpp")
ENV = "QUANTGATE_WOQ_KERNEL"  # "0" keeps torch's kernels (to measure what this one buys)
AMX_ENV = "QUANTGATE_AMX"  # "0" keeps the dpbf16 paths where AMX would run (read by the kernel per call)
TILE = 16


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in kernels.cpu_signature().split()


def cpu_has_amx() -> bool:
    return "amx_bf16" in kernels.cpu_signature().split()


@contextmanager
def without_amx() -> Iterator[None]:
    """The kernel's dpbf16 paths only, for the calls made inside (to measure what AMX buys)."""
    before = os.environ.get(AMX_ENV)
    os.environ[AMX_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(AMX_ENV, None)
        else:
            os.environ[AMX_ENV] = before


def available(device: torch.device | str = "cpu") -> bool:
    if torch.device(device).type != "cpu" or os.environ.get(ENV, "1").strip() == "0" or not cpu_has_avx512_bf16():
        return False
    return kernels.load(SOURCE) and hasattr(torch.ops.quantgate_woq, "woq_linear_int8")


def fits(in_features: int, out_features: int, group_size: int | None = None) -> bool:
    """The kernel's shape rules: N a multiple of 16, K even (int8) or int4 groups a multiple of 8."""
    if group_size is not None:
        return out_features % TILE == 0 and group_size % 8 == 0 and in_features % group_size == 0
    return in_features % 2 == 0 and out_features % TILE == 0


def int16_rows_below(int4: bool) -> int:
    """Calls with fewer rows take the exact int16 paths where AMX does not take them (every call on Intel
    CPUs without AMX; 8 rows for int4 and 24 for int8 elsewhere); from there the bf16 panel."""
    return int(torch.ops.quantgate_woq.int16_rows_below(int4))


def int8_width(in_features: int) -> int:
    """Inputs per channel an int8 weight is packed with here: 4 (quads) where the AMX-INT8 path runs it,
    else 2 (pairs)."""
    return 4 if available() and torch.ops.quantgate_woq.amx_int8_ready(in_features) else 2


def pack_int8(weight: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """[N, K] int8 -> [N/16, K/width, 16, width]: 16 channels at `width` consecutive inputs per row, pairs
    for the dpbf16 and int16 paths, quads for AMX-INT8 (default: `int8_width(K)`)."""
    n, k = weight.shape
    width = width or int8_width(k)
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
    nibbles = q.to(torch.int32).view(n // TILE, TILE, k // 8, 4, 2).permute(0, 2, 1, 4, 3)
    words = (nibbles << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1)
    words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    return words.reshape(n // TILE, k // 8, 2 * TILE).contiguous()


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


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] bf16 (contiguous) -> [M, N] in out_dtype: x @ (q * scales)^T."""
    return torch.ops.quantgate_woq.woq_linear_int8(x, packed, scales, out_dtype)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.quantgate_woq.woq_linear_bf16(x, packed, out_dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, n: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.quantgate_woq.woq_linear_int4(x, packed, scales_zeros, group_size, n, out_dtype)
