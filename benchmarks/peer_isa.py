"""Every peer server forced onto one x86 instruction set (`bench peers --isa avx2`): what a CPU that has
only AVX2 would run, measured on a CPU that has more. `bench variants --isa avx2` re-runs itself the same
way (`run_forced`), so that the baseline's torch GEMMs are AVX2's too.

Each engine picks its code from the CPU's flags, so each is forced its own way:
- torch inside every server (ATen's kernels, oneDNN, MKL): their documented environment switches;
- quantgate: `QUANTGATE_ISA` (its kernel path, and with it the fp32 activations a CPU without native
  bf16 gets);
- vLLM's CPU build: it loads `_C_AVX512` or `_C_AVX2` after asking `torch.cpu._is_avx512_supported()`,
  which reads the CPU, not those switches; `peer_isa_site/sitecustomize.py`, put on its PYTHONPATH (every
  process of its tree imports it at startup), answers no for AVX-512 and AMX;
- llama.cpp: compiled for the ISA (`LLAMA_ISA=avx2 scripts/peers_setup_llama.sh`), found under
  $QUANTGATE_HOME/peers/llama.cpp-avx2 unless `--llama-dir` says otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from quantgate import settings

ISAS = ("avx2",)
SITE_DIR = Path(__file__).with_name("peer_isa_site")
TORCH_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def check(isa: str | None) -> None:
    if isa is not None and isa not in ISAS:
        raise ValueError(f"--isa {isa!r}: servers can be forced onto {', '.join(ISAS)} (or left native)")


def llama_dir_name(isa: str | None) -> str:
    return "llama.cpp" if isa is None else f"llama.cpp-{isa}"


def forced_env(env: dict[str, str], kind: str, isa: str | None) -> dict[str, str]:
    """`env` for a `kind` server ("quantgate", "vllm", "llama") forced onto `isa` (None: unchanged)."""
    if isa is None:
        return env
    check(isa)
    env = {**env, **TORCH_ENV[isa]}
    if kind == "quantgate":
        env[settings.ISA.name] = isa
    elif kind == "vllm":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def torch_isa() -> str:
    """The instruction set ATen's CPU kernels run in this process ("AVX2", "AVX512", ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def torch_forced(isa: str) -> bool:
    return torch_isa().lower() == isa


def run_forced(module: str, argv: list[str], isa: str) -> None:
    """`python -m module argv` in a child whose torch (ATen, oneDNN, MKL) is forced onto `isa`: those
    libraries read their switches once, at load, so this process cannot switch them itself."""
    env = forced_env(dict(os.environ), "quantgate", isa)
    print(f"re-running with torch forced onto {isa} ({', '.join(f'{k}={v}' for k, v in TORCH_ENV[isa].items())})",
          flush=True)
    subprocess.run([sys.executable, "-m", module, *argv], env=env, check=True)
