"""quantgate's own CPU kernels, compiled on first use with the machine's C++ compiler.

`paged_decode()` returns `torch.ops.quantgate.paged_decode` (paged_attention.cpp) or None where it cannot
run: another device, no compiler, or `QUANTGATE_PAGED_KERNEL=0`; callers then take the torch path. The
build (~20–60 s) is cached under `QUANTGATE_HOME/kernels/` (or `QUANTGATE_KERNEL_DIR`), keyed by the source, the torch version and
the CPU (it is built with `-march=native`, so a cache copied to another CPU is never loaded there).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]  # fast-math: vectorized expf (libmvec)
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_dir() -> Path:
    from quantgate.env import home

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_signature().encode(), " ".join(CFLAGS).encode()):
        key.update(part)
    root = Path(os.environ.get("QUANTGATE_KERNEL_DIR") or home() / "kernels")
    path = root / f"paged_attention-{key.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def enabled() -> bool:
    return os.environ.get("QUANTGATE_PAGED_KERNEL", "1") != "0"


def _load() -> bool:
    from torch.utils.cpp_extension import load

    try:
        load(name="quantgate_kernels", sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(build_dir()), is_python_module=False, verbose=False)
        return hasattr(torch.ops.quantgate, "paged_decode")
    except Exception as err:  # no compiler, no headers: the torch path still serves
        log.warning("quantgate's paged-attention kernel could not be built (%s); using the torch path", err)
        return False


def paged_decode(device: torch.device | str = "cpu"):
    """The compiled decode op for this device, or None."""
    if torch.device(device).type != "cpu" or not enabled():
        return None
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
    return torch.ops.quantgate.paged_decode if _state["loaded"] else None
