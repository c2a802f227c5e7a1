"""Importing any flows/ module leaves `os.environ` as it was: the Prefect environment is set at the edges
(the CLI verbs, `release_flow` at its start, the deployment's job variables), never by an import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import flows

FLOWS = sorted(f"flows.{p.stem}" for p in Path(flows.__file__).parent.glob("*.py") if p.stem != "__init__")

# torch's own import side effect, not ours: torch._dynamo (imported by transformers' modeling_utils) sets
# TORCHINDUCTOR_CACHE_DIR. The child imports it before taking the snapshot, so only flows/ code is judged.
THIRD_PARTY_FIRST = ("torch._dynamo",)

CHILD = """
import importlib, json, os, sys
for name in sys.argv[1].split(","):
    importlib.import_module(name)
before = dict(os.environ)
changed = {}
for name in sys.argv[2:]:
    importlib.import_module(name)
    now = dict(os.environ)
    diff = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    if diff:
        changed[name] = diff
        before = now
print(json.dumps(changed))
"""


def test_importing_flows_modules_leaves_the_environment_unchanged(tmp_path):
    """Every flows/ module imported in a fresh interpreter whose environment holds none of quantgate's
    defaults (a bare one, as a worker's may be): nothing is added, changed or removed."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "QUANTGATE_HOME", "QUANTGATE_KERNEL_DIR", "QUANTGATE_DTYPE",
            "TRITON_INTERPRET", "OMP_WAIT_POLICY")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONPATH"] = str(Path(flows.__file__).parents[1])
    assert FLOWS, "no flows/ modules found"
    out = subprocess.run([sys.executable, "-c", CHILD, ",".join(THIRD_PARTY_FIRST), *FLOWS], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    changed = json.loads(out.stdout.strip().splitlines()[-1])
    assert changed == {}, f"imports that changed os.environ (module: variables): {changed}"
