"""Weight-only linears as Triton kernels that dequantize inside the GEMM, reading quantize/'s layouts as
they are:

- int8 (serving/model/quant/int8.py): codes [N, K] with a float32 scale per output row (half the bytes of bf16),
  turned into the activations' dtype in registers (exact: |code| <= 127), float32 accumulation, the row
  scale at the end: y = (x @ codes^T) * scale + bias;
- int4 (serving/model/quant/int4.py): two codes a byte [N, K/2] (low nibble: even k), a bf16 scale and zero per group
  of K [K/g, N, 2] (a quarter of the bytes of bf16): w = (code - 8) * scale + zero, rounded as quantize's
  own dequantization rounds in the activations' dtype; even and odd k are two dots over the same bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.cuda.decode import MIN_DOT, dot_precision
from serving.kernels.cuda.interpreter import dot_operand, interpreted, round_to

BLOCK_N, BLOCK_K = 64, 128


@triton.jit
def _int8_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, x_stride, w_stride, out_stride,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * x_stride + k[None, :], mask=(rm < M)[:, None] & (k < K)[None, :],
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * w_stride + k[:, None], mask=(rn < N)[None, :] & (k < K)[:, None],
                    other=0)
        acc += tl.dot(dot_operand(x, dtype, INTERPRETED), dot_operand(w.to(tl.float32), dtype, INTERPRETED),
                      input_precision=PRECISION)
    acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * out_stride + rn[None, :], round_to(acc, dtype, INTERPRETED),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 or bf16), codes [N, K] int8, scales [N] float32 -> [M, N] in x's dtype."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = max(MIN_DOT, min(64, triton.next_power_of_2(m)))
    _int8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))](
        x, codes, scales, bias if bias is not None else scales, out, m, n, k, x.stride(0), codes.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION=dot_precision(x.dtype), INTERPRETED=interpreted(x),
    )
    return out


@triton.jit
def _dequantize4(code, scale, zero, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """(code - 8) * scale + zero, each op rounded to `dtype` as serving/model/quant/int4.py's dequantization rounds;
    returned as tl.dot takes it."""
    w = round_to((code.to(tl.float32) - 8.0) * scale, dtype, INTERPRETED).to(tl.float32) + zero
    return dot_operand(round_to(w, dtype, INTERPRETED), dtype, INTERPRETED)


@triton.jit
def _int4_linear_kernel(x_ptr, codes_ptr, sz_ptr, bias_ptr, out_ptr, M, N, K, x_stride, codes_stride,
                        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rh = tl.arange(0, BLOCK_K // 2)  # byte j of the tile holds k = 2j (low nibble) and 2j + 1
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * x_stride
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * rh
        kmask = even < K
        xmask = (rm < M)[:, None] & kmask[None, :]
        x_even = tl.load(x_rows + even[None, :], mask=xmask, other=0.0)
        x_odd = tl.load(x_rows + even[None, :] + 1, mask=xmask, other=0.0)
        wmask = (rn < N)[None, :] & kmask[:, None]
        byte = tl.load(codes_ptr + rn[None, :].to(tl.int64) * codes_stride + (k0 // 2 + rh)[:, None], mask=wmask,
                       other=0).to(tl.int32)
        at = ((even // GROUP)[:, None].to(tl.int64) * N + rn[None, :]) * 2
        scale = tl.load(sz_ptr + at, mask=wmask, other=0.0).to(tl.float32)
        zero = tl.load(sz_ptr + at + 1, mask=wmask, other=0.0).to(tl.float32)
        w_even = _dequantize4(byte & 0xF, scale, zero, dtype, INTERPRETED)
        w_odd = _dequantize4(byte >> 4, scale, zero, dtype, INTERPRETED)
        acc += tl.dot(dot_operand(x_even, dtype, INTERPRETED), w_even, input_precision=PRECISION)
        acc += tl.dot(dot_operand(x_odd, dtype, INTERPRETED), w_odd, input_precision=PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], round_to(acc, dtype, INTERPRETED),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def int4_linear(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], codes [N, K/2] uint8, scales_and_zeros [K/g, N, 2] -> [M, N] in x's dtype."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    if k % group_size or group_size % 2:
        raise ValueError(f"in_features {k} must be a multiple of the (even) group size {group_size}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = max(MIN_DOT, min(64, triton.next_power_of_2(m)))
    sz = scales_and_zeros.contiguous()
    _int4_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))](
        x, codes, sz, bias if bias is not None else sz, out, m, n, k, x.stride(0), codes.stride(0),
        GROUP=group_size, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION=dot_precision(x.dtype), INTERPRETED=interpreted(x),
    )
    return out
