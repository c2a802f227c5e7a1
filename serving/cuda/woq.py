"""Weight-only int8 linear as one Triton kernel that dequantizes inside the GEMM: int8 codes [N, K] with a
float32 scale per output row (quantize/weight_only.py's layout) are read as they are (half the bytes of
bf16), turned into the activations' dtype in registers (exact: |code| <= 127), multiplied on the tensor
cores with float32 accumulation, and scaled per row at the end: y = (x @ codes^T) * scale + bias."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.cuda.decode import MIN_DOT, dot_precision
from serving.cuda.interpreter import dot_operand, interpreted, round_to

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
