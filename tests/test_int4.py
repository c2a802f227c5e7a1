"""int4wo's layer: quantization error within half a step, torch's CPU kernel and the wide (dequantize +
GEMM) path agree, quantgate's kernel matches the exact sums, and after dropping the plain codes each
serves from its kernel layout alone."""

from __future__ import annotations

import torch

import quantize.int4 as int4
from quantize.int4 import Int4WeightOnlyLinear, cpu_layout_known, quantize_groups, unpack_cpu_layout


def test_this_torch_packs_the_layout_we_unpack():
    assert cpu_layout_known()
    q = torch.randint(0, 16, (192, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    assert torch.equal(unpack_cpu_layout(int4.pack_for_cpu(q), 192, 64).int(), q)


def test_quantization_error_is_at_most_half_a_step_per_group():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    codes, sz = quantize_groups(w, 32)
    assert codes.shape == (64, 64) and codes.dtype == torch.uint8 and sz.shape == (4, 64, 2)
    back = int4.dequantize_rows(codes, sz, 32, torch.float32)
    step = sz[..., 0].float().t().repeat_interleave(32, dim=1)  # [64, 128]
    assert ((back - w).abs() <= step * 0.5 + 0.02 * w.abs().amax()).all()  # + bf16 rounding of scale/zero


def test_kernel_and_wide_paths_agree_and_codes_can_be_dropped(monkeypatch):
    monkeypatch.setenv("QUANTGATE_WOQ_KERNEL", "0")  # torch's kernels (CPUs without AVX-512-BF16)
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 192, bias=True)
    layer = Int4WeightOnlyLinear.from_linear(linear, 32)
    x = torch.randn(5, 128)
    monkeypatch.setattr(int4, "FAST_PATH_MAX_ROWS", 1 << 20)
    kernel = layer(x)
    monkeypatch.setattr(int4, "FAST_PATH_MAX_ROWS", 0)
    wide = layer(x)
    reference = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float32), linear.bias)
    scale = reference.abs().max()
    assert (kernel - reference).abs().max() < 0.02 * scale and (wide - reference).abs().max() < 0.02 * scale
    before = layer.codes.numel()
    layer.drop_codes()
    assert before == 192 * 64 and layer.codes.numel() == 0 and layer._packed.numel() == 192 * 64
    assert torch.equal(layer(x), wide)  # the wide path now dequantizes from the kernel layout
    monkeypatch.setattr(int4, "FAST_PATH_MAX_ROWS", 1 << 20)
    assert torch.equal(layer(x), kernel)


def test_own_kernel_gives_the_exact_group_sums_and_serves_after_dropping_codes():
    from quantize import kernels as woq

    assert woq.available() == woq.cpu_has_avx512_bf16()  # a compiler is there wherever the tests run
    if not woq.available():
        return  # torch's kernels serve: covered above
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 192, bias=True)
    layer = Int4WeightOnlyLinear.from_linear(linear, 32)
    x = torch.randn(5, 128)  # few rows: exact group sums of x (bf16, then rounded to int16 per row)
    weight = layer.dequantized_weight(torch.float32)
    reference = torch.nn.functional.linear(x.bfloat16().float(), weight, linear.bias)
    y = layer(x)
    assert layer._woq_codes is not None and layer._packed is None
    assert (y - reference).abs().max() < 1e-4 * reference.abs().max()
    layer.drop_codes()
    assert layer.codes.numel() == 0 and layer._woq_codes.numel() * 2 == 192 * 64
    assert torch.equal(layer(x), y)
    assert torch.equal(layer.dequantized_weight(torch.float32), weight)
