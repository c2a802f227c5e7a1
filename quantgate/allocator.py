"""tcmalloc under the `quantgate` process, where the machine has it (as vLLM's CPU docs advise).

With glibc's malloc every large tensor of a prefill step comes back as fresh pages, which the kernels
that write them then fault in one by one; tcmalloc keeps freed memory for the next step, so a prefill
step's large outputs reuse pages already mapped (figures and the command that measures them:
docs/results/design-figures.md). The library must be loaded before the process starts, so the
CLI re-executes itself once with it in LD_PRELOAD. `QUANTGATE_TCMALLOC=0` keeps glibc's malloc; a machine
without the library (Debian: libtcmalloc-minimal4, `scripts/install_tcmalloc.sh`) runs as before.
"""

from __future__ import annotations

import glob
import os
import sys

from quantgate import settings

PATTERNS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib*/libtcmalloc_minimal.so.4",
            "/usr/local/lib/libtcmalloc_minimal.so*")


def tcmalloc_path() -> str | None:
    for pattern in PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def preloaded() -> bool:
    return "tcmalloc" in os.environ.get("LD_PRELOAD", "")


def reexec_with_tcmalloc(command: list[str]) -> bool:
    """Replace this process by `command` with tcmalloc preloaded; False (and nothing done) where it is
    off, missing, already loaded, or not Linux. Call before anything else has run."""
    if not settings.enabled(settings.TCMALLOC) or preloaded() or not sys.platform.startswith("linux"):
        return False
    path = tcmalloc_path()
    if path is None:
        return False
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)
    return True  # not reached


def release_freed_memory() -> None:
    """Hand the heap pages freed so far back to the OS, whichever allocator holds them: tcmalloc keeps freed
    spans for reuse (a release's flow process stayed at the baseline's 3.1 GB measure peak through every later
    stage, Qwen2.5-Coder-0.5B; 0.63 GB after this), glibc keeps freed chunks in its heap (a loaded variant
    carried ~40 % of its weights' bytes in freed pages after repacking)."""
    import ctypes

    try:
        this_process = ctypes.CDLL(None)
    except OSError:
        return
    release = getattr(this_process, "MallocExtension_ReleaseFreeMemory", None)  # tcmalloc, where preloaded
    if release is not None:
        release()
    trim = getattr(this_process, "malloc_trim", None)  # glibc: what did not come from tcmalloc
    if trim is not None:
        trim(0)


def release_engine_memory() -> None:
    """Collect a dropped engine now and hand its freed heap pages back to the OS before the next one loads."""
    import gc

    gc.collect()
    release_freed_memory()
