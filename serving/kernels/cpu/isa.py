"""Which kernel path (instruction set) runs here: decided once per process from the CPU flags.

Paths, fastest first. `amx` and `avx512bf16`: quantgate's bf16 kernels (`wo_bf16.cpp`), the first
built with AMX tiles for the CPUs that have them, the second without (AVX-512-BF16 dot products only). `avx512`, `avx2`, `scalar`: the weight-only kernels over fp32 activations of
`serving/kernels/cpu/wo_fp32.cpp`, one source compiled per instruction set with that set's flags only
(`-mavx2 -mfma -mf16c` for avx2, never `-march=native`, so a forced lower path holds no instruction the
real lower CPU lacks). `torch`: torch's own ops, none of ours. `QUANTGATE_ISA` sets the process default;
an engine's `isa=` overrides it for the models it loads (`using`: layers record the path in force when they
are built), and every path the CPU runs can be forced on it.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache, lru_cache
from pathlib import Path

from quantgate import settings

ISAS = ("amx", "avx512bf16", "avx512", "avx2", "scalar", "torch")
BF16_PATHS = ("amx", "avx512bf16")  # bf16 activations through wo_bf16.cpp
# what each path needs of /proc/cpuinfo's flags
REQUIRED_FLAGS: dict[str, frozenset[str]] = {
    "amx": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile", "amx_bf16",
                      "amx_int8"}),
    "avx512bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "scalar": frozenset(),
    "torch": frozenset(),
}
# the compiler flags each path is built with (in the build cache key)
NO_AMX_CFLAGS = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]  # the avx512bf16 build of a source with tile code
ISA_CFLAGS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}


def vector_cflags(isa: str, namespace: str) -> list[str]:
    """A source written against the vector layer (vec.h) built for `isa` (avx512, avx2, scalar), its ops under
    `namespace`: that instruction set's flags only, so a forced lower path runs what a real lower CPU would."""
    return ["-O3", "-fopenmp", "-ffp-contract=fast", *ISA_CFLAGS[isa], f"-DQG_ISA_{isa.upper()}",
            f"-DQG_NAMESPACE={namespace}"]


@cache
def _cpuinfo(field: str) -> str | None:
    """The first processor's `field` in Linux's /proc/cpuinfo; None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The processor's feature flags; empty where they cannot be read."""
    return frozenset((_cpuinfo("flags") or "").split())


@lru_cache(maxsize=1)
def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ...; empty where it cannot be read."""
    return _cpuinfo("vendor_id") or ""


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def supported(flags: frozenset[str] | None = None) -> list[str]:
    """The paths this CPU runs, fastest first (`scalar` and `torch` everywhere; SIMD paths on x86 only)."""
    flags = cpu_flags() if flags is None else flags
    simd = [i for i in ISAS[:4] if REQUIRED_FLAGS[i] <= flags] if x86() or flags else []
    return [*simd, "scalar", "torch"]


def best(flags: frozenset[str] | None = None) -> str:
    return supported(flags)[0]


def check(isa: str) -> str:
    """`isa` if this CPU runs it, else a ValueError naming what it does run."""
    if isa not in ISAS:
        raise ValueError(f"unknown kernel path {isa!r}; choose one of {', '.join(ISAS)} (or auto)")
    if isa not in supported():
        missing = sorted(REQUIRED_FLAGS[isa] - cpu_flags())
        raise ValueError(f"this CPU cannot run the {isa} kernels (missing {', '.join(missing)}); "
                         f"it runs {', '.join(supported())}")
    return isa


@lru_cache(maxsize=1)
def _process_default() -> str:
    chosen = settings.isa()
    return best() if chosen == "auto" else check(chosen)


_override: ContextVar[str | None] = ContextVar("quantgate_isa", default=None)


def resolve(isa: str | None = None) -> str:
    """An explicit path (checked), else the one `using` set, else the process default (`QUANTGATE_ISA`,
    else the best here)."""
    if isa not in (None, "auto"):
        return check(isa)
    return _override.get() or _process_default()


@contextmanager
def using(isa: str | None) -> Iterator[str]:
    """Layers built inside take path `isa` (None / "auto": the process default)."""
    token = _override.set(None if isa in (None, "auto") else check(isa))
    try:
        yield resolve()
    finally:
        _override.reset(token)


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """The CPU multiplies bf16 natively (elsewhere torch's bf16 matmul is emulated or a scalar loop)."""
    return bool({"avx512_bf16", "amx_bf16"} & (cpu_flags() if flags is None else flags))


def describe() -> dict[str, object]:
    """The machine and the kernel path, as reports and measure-cache keys name them."""
    flags = cpu_flags()
    wanted = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8")
    return {"cpu_model": cpu_model(), "cpu_flags": [f for f in wanted if f in flags], "isa": resolve(),
            "machine": platform.machine()}
