"""The `quantgate` process re-executes itself once with tcmalloc preloaded where the machine has it
(quantgate/allocator.py), and not with QUANTGATE_TCMALLOC=0 or when it is loaded already."""

from __future__ import annotations

import os
import subprocess
import sys

from quantgate.allocator import tcmalloc_path
from quantgate.settings import TCMALLOC

# Runs reexec_with_tcmalloc on a command that reports whether tcmalloc is mapped into its process.
PROBE = (
    "import sys; from quantgate.allocator import reexec_with_tcmalloc; "
    "reexec_with_tcmalloc([sys.executable, '-c', "
    "'import os, sys; print(\"tcmalloc\" in open(\"/proc/self/maps\").read(), sys.argv[1:], os.environ[\"LD_PRELOAD\"])', "
    "'--flag']); print('not re-executed')"
)


def _probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", TCMALLOC.name)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_the_process_is_re_executed_under_tcmalloc_where_the_machine_has_it():
    path = tcmalloc_path()
    if path is None:  # scripts/install_tcmalloc.sh could not install it: the process goes on as it was
        assert _probe() == "not re-executed"
        return
    assert _probe() == f"True ['--flag'] {path}"


def test_the_switch_and_an_existing_preload_keep_the_process_as_it_is():
    assert _probe(**{TCMALLOC.name: "0"}) == "not re-executed"
    assert _probe(LD_PRELOAD="libtcmalloc_minimal.so.4") == "not re-executed"


# Frees 400 MB of 1 MB blocks, then prints the anonymous memory before and after release_freed_memory (MB).
RELEASE = (
    "from quantgate.allocator import release_freed_memory\n"
    "def anon():\n"
    "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon')) // 1024\n"
    "blocks = [bytearray(1 << 20) for _ in range(400)]\n"
    "del blocks\n"
    "held = anon()\n"
    "release_freed_memory()\n"
    "print(held, anon())\n"
)


def test_freed_memory_goes_back_to_the_os_under_either_allocator():
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    path = tcmalloc_path()
    for env in ([{"LD_PRELOAD": path}] if path else []) + [{}]:
        out = subprocess.run([sys.executable, "-c", RELEASE], env={**base, **env}, capture_output=True, text=True,
                             timeout=120, check=True)
        held, after = map(int, out.stdout.split())
        if env:  # tcmalloc keeps the freed spans for reuse until asked to give them back
            assert held > 300, out.stdout
        assert after < 120, (env, out.stdout)
