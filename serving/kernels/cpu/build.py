"""Build and cache quantgate's own C++ CPU kernels (torch extensions) with the machine's compiler.

Each kernel is one source file (and the headers beside it) compiled on first use (~20–60 s) with
`-march=native`, cached under `QUANTGATE_HOME/kernels/` (or `QUANTGATE_KERNEL_DIR`) in a folder keyed by
the sources, the torch version, the CPU and the flags, so a cache copied to another CPU is never loaded
there. A source built for one instruction set (`serving.kernels.cpu.isa`) gets that set's flags instead of
`-march=native` and a name of its own, so several builds of one source load side by side. A failed build (no compiler, no headers) is logged once and reported as False: callers keep their
torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from quantgate import settings

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


# the Python that decides which kernel serves a layer and how it is called changes a speed as much as the C++
DISPATCH_FILES = ("serving/model/quant/kernel_path.py", "serving/model/quant/weight_only.py",
                  "serving/model/quant/int8.py", "serving/model/quant/int4.py", "serving/model/packed_linear.py", "serving/model/fused_linear.py", "serving/model/llama_forward.py",
                  "serving/model/decode_step.py")


def sources_hash() -> str:
    """One hash over every kernel source quantgate builds and the Python that dispatches to them (a measured
    speed is only as current as these)."""
    root = Path(__file__).resolve().parents[3]
    key = hashlib.sha256()
    paths = [p for pattern in ("serving/kernels/cpu/**/*",)
             for p in sorted(root.glob(pattern)) if p.suffix in (".cpp", ".h", ".hpp", ".py")]
    for path in [*paths, *(root / f for f in DISPATCH_FILES)]:
        if path.is_file():
            key.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return key.hexdigest()[:16]


def build_dir(source: Path, cflags: list[str] = CFLAGS, name: str | None = None) -> Path:
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source includes beside it
    for part in (source.read_bytes(), *headers, torch.__version__.encode(), cpu_signature().encode(),
                 " ".join(cflags).encode()):
        key.update(part)
    path = settings.kernel_dir() / f"{name or source.stem}-{key.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(source: Path, cflags: list[str] = CFLAGS, name: str | None = None) -> bool:
    """Compile (or reuse) and load `source` once per process as extension `name` (default: its stem);
    True if it loaded."""
    name = name or source.stem
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(source, cflags, name)
        return _loaded[name]


def _build(source: Path, cflags: list[str], name: str) -> bool:
    from torch.utils.cpp_extension import load as load_extension

    try:
        directory = build_dir(source, cflags, name)
        with _one_builder(directory):
            load_extension(name=f"quantgate_{name}", sources=[str(source)], extra_cflags=cflags,
                           extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                           verbose=False)
        return True
    except Exception as err:  # no compiler, no headers: the torch path still serves
        log.warning("quantgate's %s kernel could not be built (%s); using the torch path", name, err)
        return False


@contextmanager
def _one_builder(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads in `directory`, under a lock the OS releases when its holder
    dies. torch's own (a `lock` file in the same folder) stays behind when a process is killed inside
    `load` — a server stopped, a Ray replica scaled down while it loaded its kernels — and every later
    process would wait for it forever; under this lock a leftover one can only be a dead process's."""
    with open(directory / "quantgate.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield
