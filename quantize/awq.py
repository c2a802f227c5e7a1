"""AWQ (Lin et al., 2023): activation-aware per-input-channel scales, folded where they cost nothing.

Weights that meet large activations matter more. For a group of linears reading the same input x, AWQ
scales input channel c of their weights by s_c and divides the operation before them (an RMSNorm's weight,
or the rows of the linear that produces x) by s_c: exact in floating point, but the quantization grid now
spends its resolution where x is large. s = mean|x|^a / mean|w|^(1-a) (AutoAWQ's "duo" scaling) with a
searched on a grid to minimise the group's output error after round-to-nearest; s = 1 (plain
round-to-nearest) is always a candidate, so the search never does worse than it on the calibration data.

Its cost per parameter is flat: each candidate's error is measured on a fixed sample of calibration rows
(SEARCH_ROWS) and of output rows (all of a small stage, a sixteenth of a wide one), on every core, in bf16
where the CPU multiplies it natively (benchmarks/awq_search.py: held-out error 0.9987x the full fp32
search's on Qwen2.5-Coder-0.5B's first four layers, 11.9x faster).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantize.group_grid import fake_quantize
from serving.kernels.cpu.isa import native_bf16

DEFAULT_GRID = 20
SEARCH_ROWS = 2048  # calibration rows (spread over every sequence) the search measures the output error on
SEARCH_OUTPUTS = 256  # at least this many output rows (a fixed, even spread) carry the candidates' error
OUTPUT_SHARE = 16  # ... and at least one in OUTPUT_SHARE of them: the search's cost stays flat per parameter
SEARCH_DTYPE: torch.dtype | None = None  # x D^T's dtype; None: bf16 where the CPU has it natively, else fp32
BF16_SPEEDUP = 6  # a native bf16 matmul's speed over fp32 (AMX): x D^T in bf16 beats the fp32 Gram form sooner
ERROR_CHUNK = 1 << 22  # weight elements fake-quantized at a time: bounds the search's temporaries


@dataclass(frozen=True)
class ScaleChoice:
    scales: torch.Tensor  # [K] per input channel; ones = round-to-nearest
    alpha: float | None  # None: s = 1 won
    error: float  # mean squared output error at the chosen scales
    rtn_error: float  # the same at s = 1


def search_scales(x: torch.Tensor, weights: list[torch.Tensor], group_size: int, bits: int,
                  grid: int = DEFAULT_GRID, x_mean: torch.Tensor | None = None) -> ScaleChoice:
    """The per-channel scales for `weights` (each [N_i, K]) reading inputs `x` [T, K] (a sample of the
    calibration rows); `x_mean` is mean|x| per channel over all of them (else over the sample)."""
    x = x.reshape(-1, x.shape[-1]).float()
    x_mean = x.abs().mean(0) if x_mean is None else x_mean.float()
    weight = torch.cat([w.detach().float() for w in weights])
    n, k = weight.shape
    groups = weight.abs().view(n, k // group_size, group_size)
    w_mean = (groups / groups.amax(-1, keepdim=True).clamp(min=1e-8)).view(n, k).mean(0)
    error = _error_on(x, _output_rows(weight), group_size, bits)
    ones = torch.ones(k)
    rtn_error = error(ones)
    best = ScaleChoice(ones, None, rtn_error, rtn_error)
    for step in range(grid):
        alpha = step / grid
        scales = (x_mean.pow(alpha) / w_mean.pow(1 - alpha).clamp(min=1e-4)).clamp(min=1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        candidate = error(scales)
        if candidate < best.error:
            best = ScaleChoice(scales, alpha, candidate, rtn_error)
    return best


def _output_rows(weight: torch.Tensor) -> torch.Tensor:
    """The rows the candidates are compared on: all of a small stage, else an even spread (every candidate
    sees the same rows, so the comparison stays paired)."""
    n = weight.shape[0]
    keep = max(SEARCH_OUTPUTS, -(-n // OUTPUT_SHARE))
    return weight if keep >= n else weight[torch.linspace(0, n - 1, keep).round().long()]


def _error_on(x: torch.Tensor, weight: torch.Tensor, group_size: int, bits: int):
    """mean((x D^T)^2) over the sample, D the weight's quantization error at given scales. Computed as
    x D^T, T*K per row of D, or as sum((D G) * D) with G = x^T x, K*K per row: whichever is cheaper."""
    n, k = weight.shape
    t = x.shape[0]
    # x D^T in bf16 (fp32 accumulation) where the CPU multiplies bf16 natively: 6x faster than fp32 on AMX,
    # and the error sums agree to ~1e-5 relative, far below the gaps between the grid's candidates
    low = SEARCH_DTYPE or (torch.bfloat16 if native_bf16() else torch.float32)
    speedup = BF16_SPEEDUP if low is torch.bfloat16 else 1
    gram = (x.T.double() @ x.double()).float() if k * speedup < t else None
    x_low = x.to(low) if gram is None else None  # the Gram form never reads x again
    rows = max(1, ERROR_CHUNK // k)

    def error(scales: torch.Tensor) -> float:
        total = 0.0
        for start in range(0, n, rows):
            w = weight[start:start + rows]
            delta = fake_quantize(w * scales, group_size, bits) / scales - w
            if gram is not None:
                total += ((delta @ gram) * delta).sum().item()
            else:
                total += (x_low @ delta.to(low).T).float().square().sum().item()
        return total / (t * n)

    return error


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
        _scale_columns(linear.weight, scales)


def fold_into_linear(previous: nn.Linear, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """The rows (outputs) of `previous` divided by s feed linears whose columns are multiplied by s."""
    _set(previous.weight, previous.weight.float() / scales[:, None])
    if previous.bias is not None:
        _set(previous.bias, previous.bias.float() / scales)
    for linear in linears:
        _scale_columns(linear.weight, scales)


def _scale_columns(weight: torch.Tensor, scales: torch.Tensor) -> None:
    if weight.dtype == torch.float32:
        weight.data.mul_(scales)  # the same values as below without a second copy of the weight
    else:
        _set(weight, weight.float() * scales)


def _set(parameter: torch.Tensor, value: torch.Tensor) -> None:
    parameter.data.copy_(value.to(parameter.dtype))
