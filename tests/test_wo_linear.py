"""The weight-only kernels over fp32 activations (serving/kernels/cpu/wo_fp32.cpp) on every instruction set
this CPU runs: each format against its dequantized reference, at the row counts decode and prefill use."""

from __future__ import annotations

import pytest
import torch

from serving.kernels.cpu import isa as isas
from serving.kernels.cpu import wo_fp32
from serving.model.quant.int4 import dequantize_rows, quantize_groups
from serving.model.quant.int8 import quantize_per_channel

PATHS = [i for i in wo_fp32.PATHS if i in isas.supported()]
ROWS = [1, 3, 8, 16, 64, 300]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    err = (y - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item() + 1e-5, err


def test_every_x86_path_is_tested_here():
    assert "scalar" in PATHS
    if "avx2" in isas.cpu_flags():
        assert "avx2" in PATHS and wo_fp32.ops("avx2").isa() == "avx2"


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_matches_dequantized_reference(isa, rows):
    w = torch.randn(96, 160, generator=_gen(0))
    q, scales = quantize_per_channel(w)
    x = torch.randn(rows, 160, generator=_gen(rows))
    y = wo_fp32.linear_int8(isa, x, wo_fp32.tile(q), scales)
    _close(y, x @ (q.float() * scales[:, None]).T)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 64])
def test_int4_matches_dequantized_reference(isa, rows, group):
    w = torch.randn(48, 192, generator=_gen(1))
    codes, sz = quantize_groups(w, group)
    x = torch.randn(rows, 192, generator=_gen(rows))
    y = wo_fp32.linear_int4(isa, x, wo_fp32.tile(codes), sz, group)
    _close(y, x @ dequantize_rows(codes, sz, group, torch.float32).T)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_and_fp32_match_torch(isa, rows):
    w = torch.randn(32, 72, generator=_gen(2))
    x = torch.randn(rows, 72, generator=_gen(rows))
    _close(wo_fp32.linear_f32(isa, x, wo_fp32.tile(w)), x @ w.T)
    wb = w.to(torch.bfloat16)
    _close(wo_fp32.linear_bf16(isa, x, wo_fp32.tile(wb)), x @ wb.float().T)


def test_layouts_round_trip_and_look_rows_up():
    w = torch.randint(-127, 128, (64, 40), generator=_gen(3), dtype=torch.int8)
    packed = wo_fp32.tile(w)
    assert packed.shape == (4, 40, 16) and torch.equal(wo_fp32.untile(packed), w)
    ids = torch.tensor([[0, 17], [63, 5]])
    assert torch.equal(wo_fp32.tiled_rows(packed, ids), w[ids])


@pytest.mark.parametrize("isa", PATHS)
def test_bad_input_is_a_clear_error(isa):
    packed = wo_fp32.tile(torch.zeros(16, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="x has 6 inputs"):
        wo_fp32.linear_int8(isa, torch.zeros(1, 6), packed, torch.ones(16))


def test_a_path_the_cpu_lacks_is_refused_by_name():
    missing = [i for i in ("avx512", "avx2") if i not in isas.supported()]
    for name in missing:
        with pytest.raises(ValueError, match="cannot run"):
            isas.check(name)
    with pytest.raises(ValueError, match="unknown kernel path"):
        isas.check("neon")


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("rows", [100, 300])  # blocks of columns from worker threads; one widened buffer
def test_prefill_rows_serve_under_inference_mode(isa, rows):
    """Many rows go through torch's GEMM, from worker threads: the caller's inference mode must hold there."""
    w = torch.randn(64, 96, generator=_gen(4))
    q, scales = quantize_per_channel(w)
    x = torch.randn(rows, 96, generator=_gen(5))
    with torch.inference_mode():
        y = wo_fp32.linear_int8(isa, x, wo_fp32.tile(q), scales)
    _close(y, x @ (q.float() * scales[:, None]).T)


@pytest.mark.parametrize("isa", PATHS)
def test_prefill_over_a_weight_wider_than_one_widened_buffer(isa):
    """Prefill widens at most 4 Mi floats of weight per GEMM: 2048 x 2064 is two buffers, the second one tile."""
    q = torch.randint(-127, 128, (2064, 2048), dtype=torch.int8, generator=_gen(6))
    scales = torch.rand(2064, generator=_gen(7)) * 0.01
    x = torch.randn(260, 2048, generator=_gen(8))
    with torch.inference_mode():
        y = wo_fp32.linear_int8(isa, x, wo_fp32.tile(q), scales)
    _close(y, x @ (q.float() * scales[:, None]).T)


@pytest.fixture
def torch_gemm_from_few_rows(request):
    """The path's calls handed to torch's GEMM from 8 rows (blocks) and 40 (whole weight), as on Intel CPUs at
    their defaults; put back after. On AMD CPUs the builds never hand rows over, and this is what tests it there."""
    ops = wo_fp32.ops(request.param)
    before = ops.use_torch_gemm_from(8, 40)
    yield request.param
    ops.use_torch_gemm_from(*before)


@pytest.mark.parametrize("torch_gemm_from_few_rows", PATHS, indirect=True)
@pytest.mark.parametrize("rows", [16, 64])
def test_every_format_through_torch_gemm(torch_gemm_from_few_rows, rows):
    isa = torch_gemm_from_few_rows
    w = torch.randn(48, 128, generator=_gen(9))
    x = torch.randn(rows, 128, generator=_gen(rows))
    _close(wo_fp32.linear_f32(isa, x, wo_fp32.tile(w)), x @ w.T)
    q, scales = quantize_per_channel(w)
    _close(wo_fp32.linear_int8(isa, x, wo_fp32.tile(q), scales), x @ (q.float() * scales[:, None]).T)
    codes, sz = quantize_groups(w, 32)
    _close(wo_fp32.linear_int4(isa, x, wo_fp32.tile(codes), sz, 32),
           x @ dequantize_rows(codes, sz, 32, torch.float32).T)


def test_torch_gemm_takes_rows_only_where_it_is_fast(monkeypatch):
    """MKL's sgemm on AMD ran slower than our panels (docs/results/2026-12-07-amd-epyc-zen4-fp32-evening.md): there the
    avx512 and avx2 builds never hand rows to torch's GEMM; elsewhere the builds' defaults."""
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    monkeypatch.setattr(isas, "cpu_vendor", lambda: "AuthenticAMD")
    assert wo_fp32.torch_gemm_rows("avx512") == (wo_fp32.NO_TORCH_GEMM, wo_fp32.NO_TORCH_GEMM)
    assert wo_fp32.torch_gemm_rows("avx2") == (wo_fp32.NO_TORCH_GEMM, wo_fp32.NO_TORCH_GEMM)
    assert wo_fp32.torch_gemm_rows("scalar") is None
    monkeypatch.setattr(isas, "cpu_vendor", lambda: "GenuineIntel")
    assert wo_fp32.torch_gemm_rows("avx512") is None
    monkeypatch.setattr(isas, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert wo_fp32.torch_gemm_rows("avx512") is None
