"""GPTQ (Frantar et al., 2022) for one linear layer, onto the int4 layout's grid.

Columns (inputs) are quantized left to right; each column's rounding error is spread over the columns not
yet quantized through the inverse Hessian of the layer's inputs, H = 2 X^T X, so the layer's *output* on
the calibration inputs moves as little as possible. The inverse comes from a Cholesky factorisation with
dampening (a fraction of the mean diagonal) for inputs that never vary. A group's scale and zero are fixed
when the sweep reaches its first column, from the columns as they are then (already corrected), as the
reference implementation does; no activation reordering, so the groups stay contiguous as the layout needs.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from quantize.group_grid import GroupCodes, dequantize_with, group_params, one_thread, quantize_with

DEFAULT_DAMP = 0.01
BLOCK = 128  # columns updated together before the rest of the matrix is corrected
THREADED_UPDATE = 1 << 20  # elements per column update from which every core helps


class Hessian:
    """Running 2 X^T X / n over the rows X a layer sees (float64 sums: thousands of tokens add up)."""

    def __init__(self, columns: int):
        self.sum = torch.zeros(columns, columns, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        self.sum += x.T @ x
        self.rows += x.shape[0]

    def matrix(self) -> torch.Tensor:
        if not self.rows:
            raise ValueError("no calibration rows reached this layer")
        return (2 * self.sum / self.rows).float()


def inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1."""
    h = h.clone()
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, bits: int,
                  damp: float = DEFAULT_DAMP) -> GroupCodes:
    """Codes, scales and zeros for `weight` [N, K] minimising the output error on inputs whose second
    moment is `hessian` [K, K]."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    if not 0 < damp < 1:
        raise ValueError(f"damp must be in (0, 1), got {damp!r}")
    w = weight.detach().float().clone()
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs that are always zero: nothing to compensate with
    h[dead, dead] = 1
    w[:, dead] = 0
    hinv = inverse_cholesky(h, damp)
    q = torch.zeros(n, k, dtype=torch.uint8)
    scale = torch.zeros(n, k // group_size)
    zero = torch.zeros(n, k // group_size)
    block = max(group_size, BLOCK // group_size * group_size)  # a whole number of groups
    # each column's update touches N x block values: worth the thread pool's fork and join only when wide
    with one_thread() if n * block < THREADED_UPDATE else nullcontext():
        for start in range(0, k, block):
            end = min(start + block, k)
            _sweep_block(w, hinv, q, scale, zero, start, end, group_size, bits)
    return GroupCodes(q, scale, zero)


def _sweep_block(w: torch.Tensor, hinv: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, start: int, end: int, group_size: int, bits: int) -> None:
    """Quantize columns start..end of `w` in place, then correct the columns after them."""
    w1 = w[:, start:end].clone()
    hinv1 = hinv[start:end, start:end]
    errors = torch.zeros_like(w1)
    for i in range(end - start):
        column = start + i
        if column % group_size == 0:
            g = column // group_size
            scale[:, g], zero[:, g] = group_params(w1[:, i:i + group_size], bits)
        g = column // group_size
        codes = quantize_with(w1[:, i:i + 1], scale[:, g], zero[:, g], bits)
        q[:, column] = codes[:, 0].to(torch.uint8)
        error = (w1[:, i] - dequantize_with(codes, scale[:, g], zero[:, g])[:, 0]) / hinv1[i, i]
        w1[:, i:] -= error[:, None] * hinv1[i, i:][None, :]
        errors[:, i] = error
    w[:, end:] -= errors @ hinv[start:end, end:]
