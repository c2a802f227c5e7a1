#!/usr/bin/env bash
# Wheels of our dependencies that the lent GPU machine's own CPython 3.12 lacks (it has torch 2.11 (CUDA 13),
# triton, transformers, accelerate, safetensors, numpy, pytest and no network), for manylinux x86-64, into
# .gpu_wheels/ (git-ignored; the run tool carries it, 64 MiB in all with the working tree; scripts/gpu_check.sh
# unpacks it there without pip). Binary ones (pydantic-core, pyyaml, psutil) are the cp312 / abi3 builds.
# bitsandbytes (int8 / nf4 on CUDA) ships a library per CUDA and ROCm version (43 MB): its wheel is rewritten
# here keeping the CPU library and CUDA 12.8 / 13.0 / 13.2 (torch 2.11's CUDA 13.0 loads cuda130), RECORD
# updated, so it still installs with pip (~14 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_wheels}
PIP=${PIP:-.venv/bin/pip}
PY=${PY:-.venv/bin/python}
mkdir -p "$DEST"
"$PIP" download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d "$DEST" \
  "pydantic==2.14.4" "pyyaml==6.0.4" "psutil==7.2.2"
# without its dependencies (torch, numpy, packaging: the machine has them; with them pip fetches a torch)
"$PIP" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi none \
  --platform manylinux_2_24_x86_64 -d "$DEST" "bitsandbytes==0.50.2"
"$PY" - "$DEST" <<'EOF'
import re, sys, zipfile
from pathlib import Path

KEEP = re.compile(r"libbitsandbytes_(cpu|cuda128|cuda130|cuda132)\.so$")
for wheel in Path(sys.argv[1]).glob("bitsandbytes-*.whl"):
    with zipfile.ZipFile(wheel) as src:
        names = [n for n in src.namelist() if "libbitsandbytes_" not in n or KEEP.search(n)]
        if len(names) == len(src.namelist()):
            continue  # trimmed before
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for name in names:
                data = src.read(name)
                if name.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    data = "\n".join(l for l in lines if "libbitsandbytes_" not in l or KEEP.search(l.split(",")[0]))
                    data = (data + "\n").encode()
                dst.writestr(src.getinfo(name), data)
    tmp.replace(wheel)
    print(f"{wheel.name}: kept {sum('libbitsandbytes_' in n for n in names)} native libraries")
EOF
ls -1 "$DEST"
size=$(du -sm "$DEST" | cut -f1)
echo "$DEST: ${size} MiB"
[ "$size" -le 40 ] || { echo "over the carry budget (64 MiB with the working tree)" >&2; exit 1; }
