"""Which device and dtype the engine runs in when the caller does not say.

On CPU, bf16 is chosen where the kernel path in force takes bf16 rows (amx, avx512bf16: the processor
multiplies bf16 natively, and the weights and KV cache take half the bytes); the fp32-row paths (avx512,
avx2, scalar) take fp32, so forcing one on any CPU runs what a CPU without native bf16 runs; the torch
path follows the processor. CUDA takes bf16. `QUANTGATE_DTYPE` overrides the choice for every engine
the process builds (tests pin float32 to compare token by token with HF in fp32).
"""

from __future__ import annotations

import torch

from quantgate import settings
from serving.kernels.cpu import isa as isas

DTYPE_ENV = settings.DTYPE.name
_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


cpu_flags = isas.cpu_flags
native_bf16 = isas.native_bf16


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype, its name, or None / "auto" (the engine chooses)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {sorted(_NAMES)}")
    return _NAMES[dtype]


def default_dtype(device: torch.device | str, isa: str | None = None) -> torch.dtype:
    override = settings.DTYPE.raw()
    if override and override != "auto":
        return parse_dtype(override)  # type: ignore[return-value]
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    path = isas.resolve(isa)
    if path != "torch":
        return torch.bfloat16 if path in isas.BF16_PATHS else torch.float32
    return torch.bfloat16 if native_bf16() else torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str, isa: str | None = None) -> torch.dtype:
    return parse_dtype(dtype) or default_dtype(device, isa)
