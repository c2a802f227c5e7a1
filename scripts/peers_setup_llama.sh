#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (and `llama-quantize`) for `quantgate bench peers --serve llama`,
# outside the repo: $QUANTGATE_HOME/peers/llama.cpp (QUANTGATE_HOME defaults to ~/.cache/quantgate).
# The sources come from the llama-cpp-python sdist on the package registry (it vendors llama.cpp), built
# natively for this CPU (-DGGML_NATIVE=ON). Takes ~15-20 minutes on 2 cores.
# LLAMA_ISA=avx2 builds for AVX2 + FMA + F16C only (no AVX-512, no AMX), into $DEST-avx2: the peer an
# AVX2-only CPU runs, to set beside `quantgate bench peers --isa avx2` on any x86 machine.
set -euo pipefail

HOME_DIR="${QUANTGATE_HOME:-$HOME/.cache/quantgate}"
ISA="${LLAMA_ISA:-native}"
case "$ISA" in
    native) ISA_FLAGS=(-DGGML_NATIVE=ON); SUFFIX="" ;;
    avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
                     -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
                     -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF); SUFFIX="-avx2" ;;
    *) echo "LLAMA_ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
DEST="${LLAMA_CPP_DIR:-$HOME_DIR/peers/llama.cpp$SUFFIX}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"

if [ -x "$DEST/bin/llama-server" ] && [ -f "$DEST/.installed" ]; then
    echo "llama.cpp peer already built: $DEST"
    exit 0
fi

work="$DEST/src"
mkdir -p "$work" "$DEST/bin"
if [ ! -d "$work/llama_cpp_python-$VERSION" ]; then
    pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
    tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
fi
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$work/build" -j "$JOBS" --target llama-server llama-quantize
cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$DEST/bin/"
"$DEST/bin/llama-server" --version 2>&1 | head -2
touch "$DEST/.installed"
echo "llama.cpp peer built: $DEST"
