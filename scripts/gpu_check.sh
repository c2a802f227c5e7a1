#!/usr/bin/env bash
# The device check for a lent CUDA machine: no network, no venv. It runs the machine's own python3 (torch 2.11,
# triton 3.6, transformers 5.17, accelerate, safetensors, numpy, pytest are there); our other dependencies come
# from the wheels scripts/gpu_wheels.sh put in .gpu_wheels/ (carried by the run), unpacked here without pip.
# Steps: versions, the CUDA test subset (tests/test_triton_kernels.py, then tests/test_bitsandbytes_engine.py on
# the device), then benchmarks/cuda_decode.py (random-weight models built on the device). Logs and JSON go under
# ${OUT:-gpu-results}; each step has a timeout, clipped to what is left of a 450 s budget, so the whole check
# ends within 8 minutes (docs/cuda.md counts the steps).
#
#   bash scripts/gpu_check.sh           the lent GPU machine
#   bash scripts/gpu_check.sh --cpu     the rehearsal: every step on CPU (the test subset in Triton's
#                                       interpreter, the benchmark on the tiny shape); budget 1500 s
#   QUANTGATE_GPU_DRYRUN=1 bash scripts/gpu_check.sh   every step up to the first CUDA call, then stop
# QUANTGATE_GPU_PYTHON names the interpreter (default python3; for --cpu and the dry run .venv/bin/python when
# it is unset). The cp312 wheels are put on PYTHONPATH only for a CPython 3.12 interpreter.
#
# On the lent machine: the run tool, carry [".gpu_wheels"], command "bash scripts/gpu_check.sh", timeout_s 500.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
[ "${1:-}" = --cpu ] && MODE=cpu
[ "${QUANTGATE_GPU_DRYRUN:-0}" = 1 ] && MODE=dry
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${QUANTGATE_GPU_PYTHON:-python3}
if [ "$MODE" != gpu ] && [ -z "${QUANTGATE_GPU_PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
BUDGET=450
[ "$MODE" = cpu ] && BUDGET=1500
WHEELS=${QUANTGATE_GPU_WHEELS:-.gpu_wheels}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  DO_NOT_TRACK=1 HF_HOME="$SCRATCH/hf" QUANTGATE_HOME="$SCRATCH/home" TRITON_CACHE_DIR="$SCRATCH/triton"
# No CPU kernel is compiled here (the check measures the CUDA path; a C++ build costs 30-90 s of the budget in
# every process): the torch path for CPU kernels, and no compiled CPU decode-step plan.
export QUANTGATE_ISA=torch QUANTGATE_DECODE_STEP=0
STATUS="$OUT/gpu_check_steps.txt"
echo "mode $MODE python $PY budget ${BUDGET}s" > "$STATUS"
step() {  # step NAME TIMEOUT CMD...: run within the budget, log to $OUT/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "$name skipped: ${left}s of the budget left" | tee -a "$STATUS"; return 124; fi
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start)) limit=$limit" | tee -a "$STATUS"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

# 1. Wheels: the ones gpu_wheels.sh fetches must all be there; unpacked as a site folder (a wheel is a zip).
missing=0
for dist in pydantic pydantic_core annotated_types typing_inspection typing_extensions pyyaml psutil bitsandbytes; do
  ls "$WHEELS" 2>/dev/null | grep -qi "^${dist}-.*\.whl$" || { echo "no wheel for $dist in $WHEELS"; missing=1; }
done
[ "$missing" = 0 ] || { echo "run scripts/gpu_wheels.sh here first"; exit 2; }
SITE="$SCRATCH/site"
mkdir -p "$SITE"
for wheel in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE" || exit 2; done
echo "unpacked $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS" | tee -a "$STATUS"
if "$PY" -c 'import sys; sys.exit(sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 12))'; then
  export PYTHONPATH="$PWD:$SITE"
else  # the cp312 wheels do not import here: the interpreter's own packages stand in
  export PYTHONPATH="$PWD"
  echo "$PY is not CPython 3.12: wheels unpacked but not used" | tee -a "$STATUS"
fi

# 2. What this machine runs (imports only: no CUDA call).
step versions 60 "$PY" -c "
import platform, torch, triton, transformers, pydantic, yaml, psutil, numpy, bitsandbytes
import serving.core.engine, serving.model.cuda.graphs, serving.model.cuda.attention, benchmarks.cuda_decode, quantize.variant
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'triton', triton.__version__, 'transformers', transformers.__version__, 'pydantic', pydantic.VERSION,
      'numpy', numpy.__version__, 'bitsandbytes', bitsandbytes.__version__, 'from', bitsandbytes.__file__)" || exit 3

TESTS=(tests/test_triton_kernels.py tests/test_bitsandbytes_engine.py)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning)
if [ "$MODE" = dry ]; then
  QUANTGATE_TEST_DEVICE=cuda step tests-collect 60 "${PYTEST[@]}" --collect-only "${TESTS[@]}"
  step bench-plan 60 "$PY" -m benchmarks.cuda_decode --dry-run
  echo "dry run: stopped before the first CUDA call" | tee -a "$STATUS"
  exit 0
fi

# 3. The device, the test subset (on the device: fp32 and bf16 kernels, the engine, bitsandbytes), the benchmark.
if [ "$MODE" = gpu ]; then
  timeout 30 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  export QUANTGATE_TEST_DEVICE=cuda
  BENCH=(--out "$OUT")
else
  export QUANTGATE_TEST_DEVICE=cpu TRITON_INTERPRET=1
  BENCH=(--out "$OUT" --device cpu --shapes tiny --batches 1,3 --wo-batches 1 --prompt 8 --warmup 2 --steps 3
         --max-len 64 --kv-gb 0.01)
fi
scale=1
[ "$MODE" = cpu ] && scale=3
step tests-kernels $((150 * scale)) "${PYTEST[@]}" "${TESTS[0]}"
step tests-bnb $((75 * scale)) "${PYTEST[@]}" "${TESTS[1]}"
step bench $((240 * scale)) "$PY" -m benchmarks.cuda_decode "${BENCH[@]}"
echo "total seconds=$SECONDS" | tee -a "$STATUS"
"$PY" - "$STATUS" "$OUT/gpu_check_steps.json" <<'PYEOF'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
steps = [dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv) | {"step": line.split()[0]}
         for line in lines[1:] if " rc=" in line or " skipped" in line]
json.dump({"header": lines[0], "steps": steps, "total": lines[-1]}, open(sys.argv[2], "w"), indent=1)
PYEOF
cat "$STATUS"
