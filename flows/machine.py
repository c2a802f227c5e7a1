"""The machine a speed was measured on: what the measure caches key on and what every report names.

A speed is only as current as the kernels that produced it and only as portable as the CPU it ran on, so
the key holds the kernel sources' hash, the kernel path in force (ISA), the CPU model and SIMD flags, the
thread count, the engine's dtype and device and quantgate's version: a fresh clone on another CPU, a
kernel change, or another thread count never reuses a cached speed.

The device is a parameter of the release (`quantgate release --device`, else `QUANTGATE_DEVICE`, else CUDA
when torch sees a GPU): it picks the default methods (quantize/methods.py), the engine's device and
attention path, and it is part of every key. A CUDA release on a machine without a GPU is refused, unless
Triton's interpreter is on (`TRITON_INTERPRET=1`): then it is rehearsed, the CUDA kernels run on CPU
tensors (tests, scripts/gpu_check.sh --cpu), and every report says so.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from functools import lru_cache
from pathlib import Path

from quantgate import settings

DEVICE_KINDS = ("cpu", "cuda")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def detect_device() -> str:
    """CUDA when torch sees a GPU, else the CPU."""
    return "cuda" if _cuda_available() else "cpu"


def rehearsed(device: str) -> bool:
    """A CUDA release without a GPU, its Triton kernels run on CPU tensors in Triton's interpreter."""
    return device.split(":")[0] == "cuda" and not _cuda_available() and settings.enabled(settings.TRITON_INTERPRET)


def resolve_device(requested: str | None = None) -> str:
    """The device a release serves on: `requested`, else QUANTGATE_DEVICE, else `detect_device()`."""
    name = (requested or settings.DEVICE.raw() or "auto").strip().lower()
    if name == "auto":
        return detect_device()
    kind, _, index = name.partition(":")
    if kind not in DEVICE_KINDS or (index and not index.isdigit()):
        raise ValueError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not _cuda_available() and not rehearsed(name):
        raise ValueError(f"device {name!r}: torch sees no CUDA GPU here (set TRITON_INTERPRET=1 to rehearse the "
                         "CUDA path on CPU tensors)")
    return name


def engine_placement(device: str) -> dict[str, str]:
    """`LLMEngine.from_pretrained`'s device and attention for a release's device: on CUDA its Triton kernels
    (attention auto), rehearsed on CPU tensors in Triton's interpreter where no GPU is."""
    if rehearsed(device):
        return {"device": "cpu", "attention": "triton"}
    return {"device": device, "attention": "auto"}


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


def describe(device: str | None = None) -> dict[str, object]:
    """CPU model and flags, kernel path, threads, dtype, device (and GPU), kernel sources hash, quantgate
    version. `device`: the release's (None: `resolve_device()`)."""
    import torch

    from serving.kernels.cpu import isa, sources_hash
    from serving.model.device import resolve_dtype

    device = resolve_device(device)
    placed = engine_placement(device)["device"]
    info: dict[str, object] = {
        **isa.describe(), "threads": torch.get_num_threads(), "device": device,
        "dtype": str(resolve_dtype(None, placed)).removeprefix("torch."), "kernel_sources": sources_hash(),
        "quantgate": _version(), "commit": _commit()}
    if placed.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(placed))
    if rehearsed(device):
        info["rehearsed"] = "CPU tensors, Triton's interpreter"
    return info


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
    gpu = f" ({info['gpu']})" if info.get("gpu") else ""
    rehearsal = f" (rehearsed: {info['rehearsed']})" if info.get("rehearsed") else ""
    return (f"{info.get('cpu_model')} ({info.get('machine')}; {flags}), kernel path {info.get('isa')}, "
            f"{info.get('threads')} threads, {info.get('dtype')} on {info.get('device')}{gpu}{rehearsal}, kernel "
            f"sources {info.get('kernel_sources')}, quantgate {info.get('quantgate')}{commit}")
