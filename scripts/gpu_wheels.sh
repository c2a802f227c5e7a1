#!/usr/bin/env bash
# Wheels of our dependencies that the lent GPU machine's own CPython 3.12 lacks (it has torch, triton,
# transformers, accelerate, safetensors, numpy, pytest and no network), for manylinux x86-64, into .gpu_wheels/
# (git-ignored; the run tool carries it, 64 MiB in all; scripts/gpu_check.sh unpacks it there without pip).
# Binary ones (pydantic-core, pyyaml, psutil) are the cp312 / abi3 builds.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_wheels}
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$DEST"
"$PIP" download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$DEST" "pydantic==2.14.4" "pyyaml==6.0.4" "psutil==7.2.2"
ls -1 "$DEST"
size=$(du -sm "$DEST" | cut -f1)
echo "$DEST: ${size} MiB"
[ "$size" -le 60 ] || { echo "over the carry budget (64 MiB with the rest)" >&2; exit 1; }
