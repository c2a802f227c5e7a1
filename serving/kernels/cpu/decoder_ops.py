"""The decoder's own CPU kernels: the paged-attention decode kernel (paged_attention.cpp), the fused
small ops (fused_ops.cpp) and, on the bf16 paths, a fresh prompt's causal attention (prefill_attention.cpp),
built by `serving.kernels.cpu.build`.

Both are plain C++ that compilers vectorise (paged attention adds AVX-512-BF16 code where the build has
it, and AMX tile code on the `amx` path). On the `amx` and `avx512bf16` paths they are built with
`-march=native` under their historical op namespaces (paged attention's `avx512bf16` build without AMX, as
`quantgate_avx512bf16`); on `avx512`, `avx2` and `scalar` with that instruction set's flags only, under
namespaces of their own (`torch.ops.quantgate_avx2`), so a forced lower path runs what a real lower CPU would. `paged_decode()`
returns the decode op, `fused_ops()` the namespace holding rms_norm, add_rms_norm and rotary, or None where
they cannot run: another device, the `torch` path, no compiler, or `QUANTGATE_PAGED_KERNEL=0` /
`QUANTGATE_FUSED_OPS=0`; callers then take the torch path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantgate import settings
from serving.kernels import cpu as kernels
from serving.kernels.cpu import isa as isas

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FUSED_SOURCE = Path(__file__).with_name("fused_ops.cpp")
STEP_SOURCE = Path(__file__).with_name("decode_step.cpp")
PREFILL_SOURCE = Path(__file__).with_name("prefill_attention.cpp")
PREFILL_FP32_SOURCE = Path(__file__).with_name("prefill_attention_fp32.cpp")
# the fp32 build each path runs (the bf16 paths' CPUs all have AVX-512)
PREFILL_FP32_BUILDS = {"amx": "avx512", "avx512bf16": "avx512", "avx512": "avx512", "avx2": "avx2", "scalar": "scalar"}
STEP_CFLAGS = ["-O2"]  # it only calls other ops: no instruction set of its own
OWN_FLAG_PATHS = ("avx512", "avx2", "scalar")


def enabled() -> bool:
    return settings.enabled(settings.PAGED_KERNEL)


def _namespace(source: Path, cflags: list[str], namespace: str, isa: str | None, tiles: bool = False):
    """Build `source` for path `isa` and return its op namespace, or None (torch path, no compiler). A source
    with tile code (`tiles`) has an `avx512bf16` build of its own, without AMX."""
    path = isas.resolve(isa)
    if path == "torch":
        return None
    if tiles and path == "avx512bf16":
        namespace = f"{namespace}_{path}"
        loaded = kernels.load(source, [*cflags, *isas.NO_AMX_CFLAGS, f"-DQG_NAMESPACE={namespace}"],
                              name=f"{source.stem}_{path}")
    elif path in OWN_FLAG_PATHS:
        namespace = f"{namespace}_{path}"
        cflags = [f for f in cflags if f != "-march=native"] + isas.ISA_CFLAGS[path] + [f"-DQG_NAMESPACE={namespace}"]
        loaded = kernels.load(source, cflags, name=f"{source.stem}_{path}")
    else:
        loaded = kernels.load(source, cflags)
    return getattr(torch.ops, namespace) if loaded else None


def paged_decode(device: torch.device | str = "cpu", isa: str | None = None):
    """The compiled decode op for this device and kernel path, or None."""
    if torch.device(device).type != "cpu" or not enabled():
        return None
    ops = _namespace(SOURCE, kernels.CFLAGS, "quantgate", isa, tiles=True)
    return ops.paged_decode if ops is not None and hasattr(ops, "paged_decode") else None


def fused_ops(device: torch.device | str = "cpu", isa: str | None = None):
    """The fused-ops namespace (rms_norm, add_rms_norm, rotary) for this device and kernel path, or None."""
    if torch.device(device).type != "cpu" or not settings.enabled(settings.FUSED_OPS):
        return None
    ops = _namespace(FUSED_SOURCE, kernels.PRECISE_CFLAGS, "quantgate_ops", isa)
    return ops if ops is not None and hasattr(ops, "rotary") else None


def prefill_fits(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a prefill kernel takes this head size: bf16 (prefill_attention.cpp) whole 32-wide tile columns
    up to 256; fp32 (prefill_attention_fp32.cpp) any multiple of 16."""
    if dtype == torch.float32:
        return head_dim % 16 == 0 and head_dim > 0
    return head_dim % 32 == 0 and 0 < head_dim <= 256


def prefill_attention(device: torch.device | str = "cpu", isa: str | None = None,
                      dtype: torch.dtype = torch.bfloat16):
    """The causal attention of a fresh prompt in `dtype`: bf16 (prefill_attention.cpp) on the `amx` path (AMX
    tiles) and the `avx512bf16` path (VDPBF16PS); fp32 (prefill_attention_fp32.cpp) on every path but `torch`,
    built for its instruction set. None: torch's flash kernel (the `torch` path, bf16 off the bf16 paths,
    `QUANTGATE_PREFILL_ATTENTION=0`, no compiler, an AMX build in a process refused the tile state)."""
    if torch.device(device).type != "cpu" or not settings.enabled(settings.PREFILL_ATTENTION):
        return None
    path = isas.resolve(isa)
    if dtype == torch.float32:
        return _prefill_fp32(PREFILL_FP32_BUILDS.get(path))
    if dtype != torch.bfloat16 or path not in isas.BF16_PATHS:
        return None
    ops = _namespace(PREFILL_SOURCE, kernels.CFLAGS, "quantgate_prefill", isa, tiles=True)
    return ops.prefill_attention if ops is not None and hasattr(ops, "prefill_attention") and ops.ready() else None


def _prefill_fp32(build: str | None):
    if build is None or build not in isas.supported():
        return None
    namespace = f"quantgate_prefill_fp32_{build}"
    if not kernels.load(PREFILL_FP32_SOURCE, isas.vector_cflags(build, namespace), name=f"prefill_fp32_{build}"):
        return None
    return getattr(torch.ops, namespace).prefill_attention.default


def decode_plan_class():
    """`torch.classes.quantgate_step.DecodePlan` (decode_step.cpp), or None where it cannot be built."""
    if not settings.enabled(settings.DECODE_STEP) or not kernels.load(STEP_SOURCE, STEP_CFLAGS):
        return None
    return torch.classes.quantgate_step.DecodePlan
