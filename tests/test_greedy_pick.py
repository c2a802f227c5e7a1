"""fused_ops.cpp greedy_pick: each row's argmax (the first of ties) or -1 where a value is NaN/inf, on every
kernel path this CPU runs; and the sampler takes the same tokens with it as without it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from serving import SamplingParams
from serving.kernels.cpu import isa as isas
from serving.kernels.cpu.decoder_ops import fused_ops
from serving.model.sampler import NO_TOKEN, sample

PATHS = [p for p in isas.supported() if p != "torch"]


def _logits(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(9, 4099, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[1, 4098] = x[1, 17] = x[1].max() + 1  # a tie: the first index wins, as torch's max gives it
    x[2, 0] = float("nan")
    x[3, 4098] = float("inf")
    x[4, 5] = -float("inf")
    x[5] = -3.0  # a flat row: index 0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", PATHS)
def test_greedy_pick_is_torchs_argmax_and_refuses_rows_that_are_not_finite(path, dtype):
    ops = fused_ops("cpu", path)
    if ops is None:
        pytest.skip(f"no compiler for the {path} build")
    x = _logits(dtype)
    picked = ops.greedy_pick(x).tolist()
    expected = x.float().max(dim=-1).indices.tolist()
    assert picked[1] == 17 and picked[5] == 0
    assert [picked[i] for i in (2, 3, 4)] == [-1, -1, -1]
    assert [picked[i] for i in (0, 6, 7, 8)] == [expected[i] for i in (0, 6, 7, 8)]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.greedy_pick(x.half())


def test_the_sampler_picks_alike_with_and_without_the_kernel():
    ops = fused_ops("cpu")
    if ops is None:
        pytest.skip("no compiled CPU kernels here")
    x = _logits(torch.bfloat16)
    seqs = [SimpleNamespace(params=SamplingParams(max_tokens=1, temperature=0.0), request_id=str(i))
            for i in range(x.shape[0])]
    with_kernel = sample(x, seqs, {}, ops.greedy_pick)
    assert with_kernel == sample(x, seqs, {}) and with_kernel[2] == with_kernel[3] == NO_TOKEN
    assert sample(x.half(), seqs, {}, ops.greedy_pick) == with_kernel  # fp16 logits: torch's argmax instead
