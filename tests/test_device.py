"""The engine's automatic dtype: bf16 where the kernel path in force takes bf16 rows (the CPU multiplies
bf16 natively), fp32 elsewhere, and every explicit choice (argument, QUANTGATE_DTYPE) wins over it."""

from __future__ import annotations

import pytest
import torch

from serving import LLMEngine
from serving.kernels.cpu import isa as isas
from serving.model.device import DTYPE_ENV, cpu_flags, default_dtype, native_bf16, parse_dtype, resolve_dtype


def test_bf16_is_native_with_avx512_bf16_or_amx_only():
    assert native_bf16(frozenset({"avx512f", "avx512_bf16"}))
    assert native_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not native_bf16(frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert not native_bf16(frozenset())


def auto_dtype(path: str) -> torch.dtype:
    """What "auto" means on kernel path `path`: bf16 on the bf16-row paths, fp32 on the fp32-row ones, the
    CPU's own choice on torch's."""
    if path == "torch":
        return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32
    return torch.bfloat16 if path in ("amx", "avx512bf16") else torch.float32


def test_auto_follows_this_cpu_and_cuda_is_bf16(monkeypatch):
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    expected = auto_dtype(isas.resolve())
    assert default_dtype("cpu") == expected
    assert resolve_dtype("auto", "cpu") == expected and resolve_dtype(None, "cpu") == expected
    assert default_dtype("cuda") == torch.bfloat16


@pytest.mark.parametrize("isa", isas.supported())
def test_auto_follows_the_kernel_path_in_force(isa, monkeypatch):
    """A forced fp32-row path (avx512, avx2, scalar) runs fp32 as a CPU without native bf16 does."""
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    expected = auto_dtype(isa)
    assert default_dtype("cpu", isa) == expected == resolve_dtype(None, "cpu", isa)
    assert resolve_dtype("bfloat16", "cpu", isa) == torch.bfloat16


def test_explicit_choices_win(monkeypatch):
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    assert default_dtype("cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32
    monkeypatch.setenv(DTYPE_ENV, "auto")
    assert default_dtype("cpu") == auto_dtype(isas.resolve())
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        parse_dtype("int3")


def test_engine_uses_the_automatic_dtype_and_its_override(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    auto = LLMEngine.from_pretrained(str(tiny_model_dir), device="cpu", num_kv_blocks=8)
    assert next(auto.model.parameters()).dtype == default_dtype("cpu")
    assert auto.runner.k_cache[0].dtype == default_dtype("cpu")
    pinned = LLMEngine.from_pretrained(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=8)
    assert next(pinned.model.parameters()).dtype == torch.float32
