"""Every `QUANTGATE_*` switch, declared once and read here (in the manner of vLLM's `envs.py`).

Each switch is a function that reads the environment when called, so a value exported before the process
starts holds for the whole process. Code never sets these at run time: an explicit argument (an engine's
`isa=`, a layer's `isa`) overrides the process default where a test or a benchmark needs another path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    doc: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default).strip()


def _switch(name: str, default: str, doc: str) -> Switch:
    switch = Switch(name, default, doc)
    SWITCHES[name] = switch
    return switch


SWITCHES: dict[str, Switch] = {}

HOME = _switch("QUANTGATE_HOME", "", "long-lived state (models, variants, MLflow store, kernels); ~/.cache/quantgate")
ISA = _switch("QUANTGATE_ISA", "auto",
              "the kernel path: auto (the best this CPU runs), amx, avx512bf16, avx512, avx2, scalar or torch")
KERNEL_DIR = _switch("QUANTGATE_KERNEL_DIR", "", "where compiled kernels are cached; QUANTGATE_HOME/kernels")
DTYPE = _switch("QUANTGATE_DTYPE", "auto", "the engine's dtype when the caller names none")
DEVICE = _switch("QUANTGATE_DEVICE", "auto",
                 "where a release serves every model when `--device` names none: auto (CUDA when torch sees "
                 "one, else CPU), cpu, cuda or cuda:N")
WOQ_KERNEL = _switch("QUANTGATE_WOQ_KERNEL", "1", "0: no bf16-activation kernel (woq); layers take the avx512 fp32 kernel, torch where it does not fit")
PAGED_KERNEL = _switch("QUANTGATE_PAGED_KERNEL", "1", "0 runs attention through torch")
FUSED_OPS = _switch("QUANTGATE_FUSED_OPS", "1", "0 runs RMSNorm/rotary through torch")
PREFILL_ATTENTION = _switch("QUANTGATE_PREFILL_ATTENTION", "1", "0 runs a fresh prompt's causal attention through "
                             "torch's flash kernel instead of prefill_attention.cpp (bf16: amx, avx512bf16) or "
                             "prefill_attention_fp32.cpp (fp32: every path but torch)")
DECODE_STEP = _switch("QUANTGATE_DECODE_STEP", "1", "0 runs decode steps' layers from Python, op by op")
PACK_WEIGHTS = _switch("QUANTGATE_PACK_WEIGHTS", "1", "0 keeps plain nn.Linear (bf16 weights, and fp32 on the avx512/avx2/scalar paths)")
FAST_FORWARD = _switch("QUANTGATE_FAST_FORWARD", "1", "0 runs the model's own forward instead of llama_forward")
TRITON_INTERPRET = _switch("TRITON_INTERPRET", "0", "Triton's own (read when kernels are defined): 1 runs "
                            "serving/kernels/cuda's kernels on CPU tensors in its interpreter (tests)")
KV_HUGE_PAGES = _switch("QUANTGATE_KV_HUGE_PAGES", "1", "0: an engine that asks for its CPU KV cache on 2 MB pages "
                        "(`quantgate serve`; serving/model/kv_memory.py) gets the allocator's 4 KB pages instead")
TCMALLOC = _switch("QUANTGATE_TCMALLOC", "1", "0: the CLI does not re-execute itself with tcmalloc preloaded")
REAL_MODELS = _switch("QUANTGATE_REAL_MODELS", "",
                      "folder holding the real GGUFs scripts/real_models.sh assembles (its models/): "
                      "tests/test_real_model.py runs on them; unset, it is skipped")
RAY_RELEASE = _switch("QUANTGATE_RAY_RELEASE", "",
                      "1: tests/test_ray_release.py also runs its heavy checks (the default model released on a "
                      "local 2-node Ray cluster against one process, item by item; a Ray worker killed mid-release); "
                      "unset, they are skipped")
USER = _switch("QUANTGATE_USER", "", "who approves and registers (recorded with each decision); the login name")
FLEET_ADMIN_KEY = _switch("QUANTGATE_FLEET_ADMIN_KEY", "", "bearer key `quantgate fleet` admin calls send")
SIGNING_KEY = _switch("QUANTGATE_SIGNING_KEY", "",
                      "ed25519 private key (PEM) that signs each release's evidence manifest; unset: unsigned")
VERIFY_KEY = _switch("QUANTGATE_VERIFY_KEY", "",
                     "ed25519 public key (PEM) `quantgate verify` checks signatures with; unset: integrity only")


def enabled(switch: Switch) -> bool:
    return switch.raw() != "0"


def home() -> Path:
    return Path(HOME.raw() or Path.home() / ".cache" / "quantgate").expanduser()


def kernel_dir() -> Path:
    return Path(KERNEL_DIR.raw()) if KERNEL_DIR.raw() else home() / "kernels"


def isa() -> str:
    return ISA.raw().lower() or "auto"


def user() -> str:
    import getpass

    return USER.raw() or getpass.getuser()


def key_path(switch: Switch) -> Path | None:
    """The key file a key switch names, or None when it is unset."""
    return Path(switch.raw()).expanduser() if switch.raw() else None


def described() -> dict[str, str]:
    """Every switch with its value in this process (for reports)."""
    return {name: s.raw() for name, s in SWITCHES.items()}

