"""Build and cache quantgate's own C++ CPU kernels (torch extensions) with the machine's compiler.

Each kernel is one source file (and the headers beside it) compiled on first use (~20–60 s) with
`-march=native`, cached under `QUANTGATE_HOME/kernels/` (or `QUANTGATE_KERNEL_DIR`) in a folder keyed by
the sources, the torch version, the CPU and the flags, so a cache copied to another CPU is never loaded
there. A failed build (no compiler, no headers) is logged once and reported as False: callers keep their
torch path.
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

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]  # fast-math: vectorized expf (libmvec)
PRECISE_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]  # ops that round where torch does
_lock = threading.Lock()
_loaded: dict[str, bool] = {}


def cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_dir(source: Path, cflags: list[str] = CFLAGS) -> Path:
    from quantgate.env import home

    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source includes beside it
    for part in (source.read_bytes(), *headers, torch.__version__.encode(), cpu_signature().encode(),
                 " ".join(cflags).encode()):
        key.update(part)
    root = Path(os.environ.get("QUANTGATE_KERNEL_DIR") or home() / "kernels")
    path = root / f"{source.stem}-{key.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(source: Path, cflags: list[str] = CFLAGS) -> bool:
    """Compile (or reuse) and load `source` once per process; True if it loaded."""
    with _lock:
        if source.stem not in _loaded:
            _loaded[source.stem] = _build(source, cflags)
        return _loaded[source.stem]


def _build(source: Path, cflags: list[str]) -> bool:
    from torch.utils.cpp_extension import load as load_extension

    try:
        load_extension(name=f"quantgate_{source.stem}", sources=[str(source)], extra_cflags=cflags,
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir(source, cflags)),
                       is_python_module=False, verbose=False)
        return True
    except Exception as err:  # no compiler, no headers: the torch path still serves
        log.warning("quantgate's %s kernel could not be built (%s); using the torch path", source.stem, err)
        return False
