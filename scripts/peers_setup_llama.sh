#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (and `llama-quantize`) for `quantgate bench peers --serve llama`,
# outside the repo: $QUANTGATE_HOME/peers/llama.cpp (QUANTGATE_HOME defaults to ~/.cache/quantgate).
# The sources come from the llama-cpp-python sdist on the package registry (it vendors llama.cpp), built
# natively for this CPU (-DGGML_NATIVE=ON). Takes ~15-20 minutes on 2 cores.
set -euo pipefail

HOME_DIR="${QUANTGATE_HOME:-$HOME/.cache/quantgate}"
DEST="${LLAMA_CPP_DIR:-$HOME_DIR/peers/llama.cpp}"
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
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$work/build" -j "$JOBS" --target llama-server llama-quantize
cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$DEST/bin/"
"$DEST/bin/llama-server" --version 2>&1 | head -2
touch "$DEST/.installed"
echo "llama.cpp peer built: $DEST"
