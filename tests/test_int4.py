"""int4wo's layer: quantization error within half a step, torch's CPU kernel and the wide (dequantize +
GEMM) path agree, quantgate's kernel matches the exact sums, and after dropping the plain codes each
serves from its kernel layout alone."""

from __future__ import annotations

import pytest
import torch

import serving.model.quant.int4 as int4
from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import wo_fp32
from serving.model.quant.int4 import (
    Int4WeightOnlyLinear,
    cpu_layout_known,
    quantize_groups,
    unpack_cpu_layout,
)

OWN_PATHS = [i for i in (*isas.BF16_PATHS, *wo_fp32.PATHS) if i in isas.supported()]


def test_this_torch_packs_the_layout_we_unpack_or_we_keep_the_codes():
    """torch's int4 CPU layout depends on the CPU that packs it (blocks of 64 rows with AVX-512, 32 with
    AVX2): where it is not the one we unpack, a layer on torch's path keeps its plain codes."""
    q = torch.randint(0, 16, (192, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    if cpu_layout_known():
        assert torch.equal(unpack_cpu_layout(int4.pack_for_cpu(q), 192, 64).int(), q)
        return
    with isas.using("torch"):
        layer = Int4WeightOnlyLinear.from_linear(torch.nn.Linear(64, 192, bias=False), 32)
    layer.drop_codes()
    assert layer.codes.numel() == 192 * 32


def test_quantization_error_is_at_most_half_a_step_per_group():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    codes, sz = quantize_groups(w, 32)
    assert codes.shape == (64, 64) and codes.dtype == torch.uint8 and sz.shape == (4, 64, 2)
    back = int4.dequantize_rows(codes, sz, 32, torch.float32)
    step = sz[..., 0].float().t().repeat_interleave(32, dim=1)  # [64, 128]
    assert ((back - w).abs() <= step * 0.5 + 0.02 * w.abs().amax()).all()  # + bf16 rounding of scale/zero


def test_kernel_and_wide_paths_agree_and_codes_can_be_dropped(monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 192, bias=True)
    with isas.using("torch"):  # torch's kernels
        layer = Int4WeightOnlyLinear.from_linear(linear, 32)
    x = torch.randn(5, 128)
    monkeypatch.setattr(int4, "FAST_PATH_MAX_ROWS", 1 << 20)
    kernel = layer(x)
    monkeypatch.setattr(int4, "FAST_PATH_MAX_ROWS", 0)
    wide = layer(x)
    reference = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float32), linear.bias)
    scale = reference.abs().max()
    assert (kernel - reference).abs().max() < 0.02 * scale and (wide - reference).abs().max() < 0.02 * scale
    if not cpu_layout_known():
        return  # codes kept: the test above
    before = layer.codes.numel()
    layer.drop_codes()
    assert before == 192 * 64 and layer.codes.numel() == 0 and layer._packed.numel() == 192 * 64
    assert torch.equal(layer(x), wide)  # the wide path now dequantizes from the kernel layout
    monkeypatch.setattr(int4, "FAST_PATH_MAX_ROWS", 1 << 20)
    assert torch.equal(layer(x), kernel)


@pytest.mark.parametrize("isa", OWN_PATHS)
def test_own_kernels_give_the_group_sums_and_serve_after_dropping_codes(isa):
    from serving.kernels.cpu import wo_bf16

    assert wo_bf16.available(isa=isa) == (isa in isas.BF16_PATHS)  # a compiler is there wherever the tests run
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 192, bias=True)
    with isas.using(isa):
        layer = Int4WeightOnlyLinear.from_linear(linear, 32)
    x = torch.randn(5, 128)
    weight = layer.dequantized_weight(torch.float32)
    # avx512bf16: exact group sums of x rounded to bf16 (then int16 per row); the others: fp32 x
    rows = x.bfloat16().float() if isa in isas.BF16_PATHS else x
    reference = torch.nn.functional.linear(rows, weight, linear.bias)
    y = layer(x)
    assert layer.kernel_path().isa == isa and layer._packed is None and layer.kernel_layout() is not None
    assert (y - reference).abs().max() < 1e-4 * reference.abs().max()
    layer.drop_codes()
    assert layer.codes.numel() == 0 and layer.kernel_layout().numel() * (2 if isa in isas.BF16_PATHS else 1) == 192 * 64
    assert torch.equal(layer(x), y)
    assert torch.equal(layer.dequantized_weight(torch.float32), weight)
