"""tcmalloc under the `quantgate` process, where the machine has it (as vLLM's CPU docs advise).

With glibc's malloc every large tensor of a prefill step (a 2048-row gate/up output is 12.6 MB) came back
as fresh pages, and this VM faults each page in at ~3 us, inside the kernels that write them: SmolLM2's
fused gate/up projection took 29.5 ms a call in a 2048-token prefill step, 4.5 ms under tcmalloc, which
keeps freed memory for the next step. `quantgate serve`: 565-609 -> 670 output tok/s on the 64-request
peers workload, TTFT p99 2.6-3.4 -> 2.4 s. The library must be loaded before the process starts, so the
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
