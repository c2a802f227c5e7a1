#!/usr/bin/env bash
# The device check for a lent CUDA machine: no network, no venv. It runs the machine's own python3 (torch 2.11,
# triton 3.6, transformers 5.17, accelerate, safetensors, numpy, pytest are there); our other dependencies come
# from the wheels scripts/gpu_wheels.sh put in .gpu_wheels/ (carried by the run), unpacked here without pip.
#
# The default run is trimmed to a 240 s budget, so that with the machine's 2-4 minute start two runs fit the
# 15 minutes lent (a second one after a fix). Steps (docs/cuda.md has their times):
#   versions       imports and versions (no CUDA call)
#   tests-kernels  tests/test_triton_kernels.py on the device, less three tests that need no GPU or only
#                  repeat the kernels through another caller: kernels vs the torch path, the engine through
#                  Triton vs torch (fp32 token-identical, bf16 within tolerance), graphs, int8/int4 GEMMs
#   bench          benchmarks/cuda_decode.py: the engine vs HF generate on the tiny shape (fp32 identical, bf16
#                  within the tests' tolerance); llama-1b decode tok/s at batch 1 and 64 for bf16, int4wo,
#                  int8wo with graphs on, prefill tok/s at 512 tokens, the batch-64 bf16 decode's share of HBM
#                  bandwidth; docs/cuda.md's targets, PASS / MISS / n/a (printed again at the end)
# --full adds the rest (budget 450 s): every test of tests/test_triton_kernels.py, tests/test_bitsandbytes_engine.py,
# and the benchmark's sweep (smollm2-135m too, batches 1-256, graphs on and off, weight-only at 1, 16, 64).
# Logs and JSON go under ${OUT:-gpu-results}; each step has a timeout, clipped to what is left of the budget,
# and the benchmark gets a time budget of its own (later runs skipped, the targets still judged).
# The exit status is 0 when every step passed (a MISSed target is a finding, not a failure).
#
#   bash scripts/gpu_check.sh [--full]           the lent GPU machine
#   bash scripts/gpu_check.sh --cpu [--full]     the rehearsal: every step on CPU (the tests in Triton's
#                                                interpreter, the benchmark on the tiny shape); budget 720 s (1500)
#   QUANTGATE_GPU_DRYRUN=1 bash scripts/gpu_check.sh [--full]   every step up to the first CUDA call, then stop
# QUANTGATE_GPU_PYTHON names the interpreter (default python3; for --cpu and the dry run .venv/bin/python when
# it is unset). The cp312 wheels are put on PYTHONPATH only for a CPython 3.12 interpreter.
#
# On the lent machine: the run tool, carry [".gpu_wheels"], command "bash scripts/gpu_check.sh", timeout_s 270
# (--full: timeout_s 500).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
FULL=0
for arg in "$@"; do
  case $arg in
    --cpu) MODE=cpu ;;
    --full) FULL=1 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--cpu] [--full]" >&2; exit 2 ;;
  esac
done
[ "${QUANTGATE_GPU_DRYRUN:-0}" = 1 ] && MODE=dry
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${QUANTGATE_GPU_PYTHON:-python3}
if [ "$MODE" != gpu ] && [ -z "${QUANTGATE_GPU_PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
# Step limits in seconds: versions, tests-kernels, tests-bnb (--full only), bench (what is left).
case $MODE$FULL in
  gpu0 | dry0) BUDGET=240; LIMITS=(40 90 0 240) ;;
  gpu1 | dry1) BUDGET=450; LIMITS=(60 150 75 240) ;;
  cpu0) BUDGET=720; LIMITS=(90 330 0 450) ;;
  cpu1) BUDGET=1500; LIMITS=(90 600 300 720) ;;
esac
WHEELS=${QUANTGATE_GPU_WHEELS:-.gpu_wheels}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
# Triton's compiled kernels outlive the run (keyed by the kernel's source, so an edited kernel compiles
# again): a second run on a machine still warm skips most of the first run's JIT, the bulk of its seconds.
TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/quantgate-gpu-check-triton}
mkdir -p "$TRITON_CACHE_DIR"
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  DO_NOT_TRACK=1 HF_HOME="$SCRATCH/hf" QUANTGATE_HOME="$SCRATCH/home" TRITON_CACHE_DIR
# No CPU kernel is compiled here (the check measures the CUDA path; a C++ build costs 30-90 s of the budget in
# every process): the torch path for CPU kernels, and no compiled CPU decode-step plan.
export QUANTGATE_ISA=torch QUANTGATE_DECODE_STEP=0
STATUS="$OUT/gpu_check_steps.txt"
echo "mode $MODE full $FULL python $PY budget ${BUDGET}s triton-cache $(ls "$TRITON_CACHE_DIR" | wc -l)" > "$STATUS"
FAILED=0
step() {  # step NAME TIMEOUT CMD...: run within the budget, log to $OUT/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "$name skipped: ${left}s of the budget left" | tee -a "$STATUS"; FAILED=1; return 124; fi
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start)) limit=$limit" | tee -a "$STATUS"
  tail -n 25 "$OUT/$name.log"
  [ "$rc" = 0 ] || FAILED=1
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

# 2. What this machine runs (imports only: no CUDA call; bitsandbytes too, which --full's tests need).
step versions "${LIMITS[0]}" "$PY" -c "
import platform, torch, triton, transformers, pydantic, yaml, psutil, numpy, bitsandbytes
import serving.core.engine, serving.kernels.cuda.graphs, serving.kernels.cuda.attention, benchmarks.cuda_decode, quantize.variant
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'triton', triton.__version__, 'transformers', transformers.__version__, 'pydantic', pydantic.VERSION,
      'numpy', numpy.__version__, 'bitsandbytes', bitsandbytes.__version__, 'from', bitsandbytes.__file__)" || exit 3

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning)
if [ "$FULL" = 1 ]; then
  KERNEL_TESTS=(tests/test_triton_kernels.py)
else  # the backend choice and the graphs' argument check run no kernel; the model's own forward (other
  # architectures) calls the same kernels as llama_forward: make test runs all three on CPU
  KERNEL_TESTS=(tests/test_triton_kernels.py -k "not own_forward and not attention_choice and not graphs_need")
fi
BENCH=(--out "$OUT")
[ "$FULL" = 1 ] && BENCH+=(--full)
if [ "$MODE" = cpu ]; then  # the tiny shape, few steps: the interpreter runs each kernel program in numpy
  BENCH+=(--device cpu --shapes tiny --batches 1,4 --wo-batches 1,4 --prompt 8 --warmup 2 --steps 3
          --prefill 32 --prefill-repeats 1 --max-len 64 --kv-gb 0.01)
fi
if [ "$MODE" = dry ]; then
  QUANTGATE_TEST_DEVICE=cuda step tests-collect 60 "${PYTEST[@]}" --collect-only "${KERNEL_TESTS[@]}"
  [ "$FULL" = 1 ] && QUANTGATE_TEST_DEVICE=cuda step tests-bnb-collect 60 "${PYTEST[@]}" --collect-only \
    tests/test_bitsandbytes_engine.py
  step bench-plan 60 "$PY" -m benchmarks.cuda_decode "${BENCH[@]}" --dry-run
  echo "dry run: stopped before the first CUDA call; rc $FAILED" | tee -a "$STATUS"
  exit $FAILED
fi

# 3. The device, the tests (on the device: fp32 and bf16 kernels, the engine), the benchmark.
if [ "$MODE" = gpu ]; then
  timeout 10 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  export QUANTGATE_TEST_DEVICE=cuda
else
  export QUANTGATE_TEST_DEVICE=cpu TRITON_INTERPRET=1
fi
step tests-kernels "${LIMITS[1]}" "${PYTEST[@]}" "${KERNEL_TESTS[@]}"
[ "$FULL" = 1 ] && step tests-bnb "${LIMITS[2]}" "${PYTEST[@]}" tests/test_bitsandbytes_engine.py
# The benchmark stops starting runs 30 s before its step's timeout (a run, the ratios and targets fit in it).
left=$((BUDGET - SECONDS))
limit=$(( left < LIMITS[3] ? left : LIMITS[3] ))
step bench "$limit" "$PY" -m benchmarks.cuda_decode "${BENCH[@]}" --time-budget $((limit > 60 ? limit - 30 : 30))
echo "total seconds=$SECONDS" | tee -a "$STATUS"
"$PY" - "$STATUS" "$OUT/gpu_check_steps.json" "$OUT/cuda_decode.json" <<'PYEOF'
import json, os, sys
lines = open(sys.argv[1]).read().splitlines()
steps = [dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv) | {"step": line.split()[0]}
         for line in lines[1:] if " rc=" in line or " skipped" in line]
json.dump({"header": lines[0], "steps": steps, "total": lines[-1]}, open(sys.argv[2], "w"), indent=1)
# The benchmark's verdicts from its JSON (rewritten after every row: there even if its step timed out).
bench = json.load(open(sys.argv[3])) if os.path.exists(sys.argv[3]) else {}
for row in bench.get("identity", []):
    print(f"identity tiny {row['dtype']} vs HF: {'PASS' if row['ok'] else 'FAIL'} (agreed {row['agreed']} of {row['lengths']})")
for row in bench.get("prefill", []):
    print(f"prefill {row['shape']} {row['variant']} {row['prompt']} tokens: {row['tok_s']:.0f} tok/s")
for t in bench.get("targets", []):
    value = "-" if t["value"] is None else f"{t['value']:.3g}"
    note = f"; {t['note']}" if t.get("note") else ""
    print(f"target {t['shape']}: {t['target']} = {value} (>= {t['threshold']:g}) {t['status']}{note}")
for what in bench.get("skipped", []):
    print("skipped:", what)
PYEOF
cat "$STATUS"
exit $FAILED
