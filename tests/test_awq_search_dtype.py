"""AWQ's search measures candidates in bf16 where the CPU has it natively, fp32 elsewhere: both paths, on
any machine (bf16 matmuls are emulated, slowly, where the CPU lacks them), measure the same errors."""

import pytest
import torch
from torch import nn

from quantize import awq, calibrated


@pytest.mark.parametrize("k, t", [(64, 512), (512, 64)])  # the Gram form and the x D^T form
def test_bf16_and_fp32_errors_agree(monkeypatch, k, t):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=gen) * torch.linspace(0.1, 4.0, k)
    weight = torch.randn(96, k, generator=gen)
    scales = torch.rand(k, generator=gen) + 0.5
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(awq, "SEARCH_DTYPE", dtype)
        error = awq._error_on(x, weight, 32, 4)
        errors[dtype] = (error(torch.ones(k)), error(scales))
    assert errors[torch.bfloat16] == pytest.approx(errors[torch.float32], rel=2e-3)
    assert errors[torch.float32][0] != errors[torch.float32][1]


@pytest.mark.parametrize("native", [False, True])
def test_calibration_forward_is_the_layer_within_bf16(monkeypatch, native):
    monkeypatch.setattr(calibrated, "native_bf16", lambda: native)
    layer = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 64)).eval()
    x = torch.randn(8, 64)

    class Wrapped(nn.Module):
        def forward(self, h):
            return h + layer(h)

    exact = calibrated.run_layer(Wrapped(), x, {})
    fast = calibrated.calibration_forward(Wrapped(), x, {})
    assert fast.dtype == torch.float32
    if native:
        assert torch.allclose(fast, exact, rtol=0, atol=0.05) and not torch.equal(fast, exact)
    else:
        assert torch.equal(fast, exact)
