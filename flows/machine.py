"""The machine a speed was measured on: what the measure caches key on and what every report names.

A speed is only as current as the kernels that produced it and only as portable as the CPU it ran on, so
the key holds the kernel sources' hash, the kernel path in force (ISA), the CPU model and SIMD flags, the
thread count, the engine's dtype and device and quantgate's version: a fresh clone on another CPU, a
kernel change, or another thread count never reuses a cached speed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from functools import lru_cache
from pathlib import Path

DEVICE = "cpu"  # where the flow serves every model (flows.measuring.load_engine)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("quantgate")
    except PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=1)
def _commit() -> str:
    """The checkout's commit (for the report only: the key uses the kernel sources, not the commit)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def describe() -> dict[str, object]:
    """CPU model and flags, kernel path, threads, dtype, device, kernel sources hash, quantgate version."""
    import torch

    from quantgate.kernels import isa, sources_hash
    from serving.model.device import resolve_dtype

    return {**isa.describe(), "threads": torch.get_num_threads(), "device": DEVICE,
            "dtype": str(resolve_dtype(None, DEVICE)).removeprefix("torch."), "kernel_sources": sources_hash(),
            "quantgate": _version(), "commit": _commit()}


def key(info: dict[str, object] | None = None) -> str:
    """A short hash of everything in `describe` that changes a speed (the commit alone does not)."""
    info = dict(describe() if info is None else info)
    info.pop("commit", None)
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]


def line(info: dict[str, object] | None = None) -> str:
    """The machine in words, for reports: "Intel Xeon ... (avx2 fma ...), kernels avx512, 2 threads, ..."."""
    info = describe() if info is None else info
    flags = " ".join(info.get("cpu_flags") or []) or "no SIMD flags read"
    commit = f" @ {info['commit']}" if info.get("commit") else ""
    return (f"{info.get('cpu_model')} ({info.get('machine')}; {flags}), kernel path {info.get('isa')}, "
            f"{info.get('threads')} threads, {info.get('dtype')} on {info.get('device')}, kernel sources "
            f"{info.get('kernel_sources')}, quantgate {info.get('quantgate')}{commit}")
