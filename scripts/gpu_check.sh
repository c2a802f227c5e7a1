#!/usr/bin/env bash
# The device check for a lent CUDA machine: no network, no venv. It runs the machine's own python3 (torch,
# triton, transformers, pytest are there); our other dependencies come from the wheels scripts/gpu_wheels.sh
# put in .gpu_wheels/ (carried by the run), unpacked here without pip. Steps: versions, the CUDA test subset
# (tests/test_triton_kernels.py on the device), then benchmarks/cuda_decode.py (random-weight models built on
# the device). Logs and JSON go under ${OUT:-gpu-results}; each step has a timeout so the whole fits 8 minutes.
#
# QUANTGATE_GPU_DRYRUN=1: every step up to the first CUDA call (wheels found and unpacked, imports, test
# collection, the benchmark's plan on the meta device), then stop. Here python3 has no torch, so the dry run
# takes .venv/bin/python unless QUANTGATE_GPU_PYTHON names another.
#
# Run it with: the run tool, carry [".gpu_wheels"], command "bash scripts/gpu_check.sh", timeout_s 540.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
DRY=${QUANTGATE_GPU_DRYRUN:-0}
PY=${QUANTGATE_GPU_PYTHON:-python3}
if [ "$DRY" = 1 ] && [ -z "${QUANTGATE_GPU_PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
WHEELS=${QUANTGATE_GPU_WHEELS:-.gpu_wheels}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  DO_NOT_TRACK=1 HF_HOME="$SCRATCH/hf" QUANTGATE_HOME="$SCRATCH/home" TRITON_CACHE_DIR="$SCRATCH/triton"
STATUS="$OUT/gpu_check_steps.txt"
: > "$STATUS"
step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$STATUS"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

# 1. Wheels: the ones gpu_wheels.sh fetches must all be there; unpacked as a site folder (a wheel is a zip).
missing=0
for dist in pydantic pydantic_core annotated_types typing_inspection typing_extensions pyyaml psutil; do
  ls "$WHEELS" 2>/dev/null | grep -qi "^${dist}-.*\.whl$" || { echo "no wheel for $dist in $WHEELS"; missing=1; }
done
[ "$missing" = 0 ] || { echo "run scripts/gpu_wheels.sh here first"; exit 2; }
SITE="$SCRATCH/site"
mkdir -p "$SITE"
for wheel in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE" || exit 2; done
echo "unpacked $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS" | tee -a "$STATUS"
if [ "$DRY" = 1 ]; then
  export PYTHONPATH="$PWD"  # the cp312 wheels do not import on this interpreter; the venv has them
else
  export PYTHONPATH="$PWD:$SITE"
fi

# 2. What this machine runs (imports only: no CUDA call).
step versions 120 "$PY" -c "
import platform, torch, triton, transformers, pydantic, yaml, psutil
import serving.engine, serving.cuda.graphs, serving.cuda.attention, benchmarks.cuda_decode
print('python', platform.python_version(), 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'pydantic', pydantic.VERSION)" || exit 3

if [ "$DRY" = 1 ]; then
  step tests-collect 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/test_triton_kernels.py
  step bench-plan 120 "$PY" -m benchmarks.cuda_decode --dry-run
  echo "dry run: stopped before the first CUDA call" | tee -a "$STATUS"
  exit 0
fi

# 3. The device, the CUDA test subset (fp32 and bf16 on the device), the benchmark.
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
QUANTGATE_TEST_DEVICE=cuda step tests-cuda 170 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
step bench-cuda 270 "$PY" -m benchmarks.cuda_decode --out "$OUT"
cat "$STATUS"
