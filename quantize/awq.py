"""AWQ (Lin et al., 2023): activation-aware per-input-channel scales, folded where they cost nothing.

Weights that meet large activations matter more. For a group of linears reading the same input x, AWQ
scales input channel c of their weights by s_c and divides the operation before them (an RMSNorm's weight,
or the rows of the linear that produces x) by s_c: exact in floating point, but the quantization grid now
spends its resolution where x is large. s = mean|x|^a / mean|w|^(1-a) (AutoAWQ's "duo" scaling) with a
searched on a grid to minimise the group's output error after round-to-nearest; s = 1 (plain
round-to-nearest) is always a candidate, so the search never does worse than it on the calibration data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantize.group_grid import fake_quantize, one_thread

DEFAULT_GRID = 20
SEARCH_ROWS = 2048  # calibration rows the search measures the output error on


@dataclass(frozen=True)
class ScaleChoice:
    scales: torch.Tensor  # [K] per input channel; ones = round-to-nearest
    alpha: float | None  # None: s = 1 won
    error: float  # mean squared output error at the chosen scales
    rtn_error: float  # the same at s = 1


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], group_size: int, bits: int,
                  grid: int = DEFAULT_GRID) -> ScaleChoice:
    """The per-channel scales for `weights` (each [N_i, K]) reading inputs `x` [T, K] (a sample)."""
    x = x.reshape(-1, x.shape[-1]).float()
    x_mean = x.abs().mean(0)
    weight = torch.cat([w.float() for w in weights])
    n, k = weight.shape
    groups = weight.abs().view(n, k // group_size, group_size)
    w_mean = (groups / groups.amax(-1, keepdim=True).clamp(min=1e-8)).view(n, k).mean(0)
    # The output error over the sample, mean((x D^T)^2) with D the weight's quantization error, is
    # sum((D G) * D) / (T N) with G = x^T x: [N, K] x [K, K] per candidate instead of [T, K] x [K, N].
    gram = (x.T.double() @ x.double()).float()
    count = x.shape[0] * n

    def error(scales: torch.Tensor) -> float:
        delta = fake_quantize(weight * scales, group_size, bits) / scales - weight
        return ((delta @ gram) * delta).sum().item() / count

    ones = torch.ones(k)
    with one_thread():
        best = ScaleChoice(ones, None, error(ones), 0.0)
        for step in range(grid):
            alpha = step / grid
            scales = (x_mean.pow(alpha) / w_mean.pow(1 - alpha).clamp(min=1e-4)).clamp(min=1e-4)
            scales = scales / (scales.max() * scales.min()).sqrt()
            candidate = error(scales)
            if candidate < best.error:
                best = ScaleChoice(scales, alpha, candidate, 0.0)
        return ScaleChoice(best.scales, best.alpha, best.error, error(ones))


# RMSNorms whose forward multiplies by (1 + weight), not by weight
OFFSET_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def norm_offset(norm: nn.Module) -> float:
    """1 for a norm computing x * (1 + w) (Gemma's), 0 for one computing x * w (Llama's)."""
    return 1.0 if type(norm).__name__ in OFFSET_NORMS else 0.0


def fold_into_norm(norm: nn.Module, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """norm(x) / s feeds linears whose columns are multiplied by s: the same outputs. A Gemma norm's
    factor is (1 + w): its new weight is (1 + w) / s - 1."""
    offset = norm_offset(norm)
    _set(norm.weight, (norm.weight.float() + offset) / scales - offset)
    for linear in linears:
        _set(linear.weight, linear.weight.float() * scales)


def fold_into_linear(previous: nn.Linear, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """The rows (outputs) of `previous` divided by s feed linears whose columns are multiplied by s."""
    _set(previous.weight, previous.weight.float() / scales[:, None])
    if previous.bias is not None:
        _set(previous.bias, previous.bias.float() / scales)
    for linear in linears:
        _set(linear.weight, linear.weight.float() * scales)


def _set(parameter: torch.Tensor, value: torch.Tensor) -> None:
    parameter.data.copy_(value.to(parameter.dtype))
