#!/usr/bin/env bash
# Install the optional xgrammar grammar backend (`--grammar-backend xgrammar`) without triton.
# xgrammar's metadata requires triton on Linux x86_64 (a large GPU compiler it only uses for its
# GPU mask kernels); sglite fills masks on the CPU with xgrammar's C++ core and applies them
# itself, so xgrammar goes in with --no-deps and its real runtime dependencies are installed
# beside it. `pip install 'sglite[xgrammar]'` also works, but pulls triton.
# Run after scripts/install.sh (torch, transformers and numpy come with sglite). Arguments go
# to pip (scripts/test.sh passes its constraints file).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch, transformers, numpy" >/dev/null 2>&1; then
  echo "install sglite first (scripts/install.sh): xgrammar needs torch, transformers, numpy" >&2
  exit 1
fi
"$PY" -m pip install --quiet "$@" "apache-tvm-ffi>=0.1.11" pydantic "typing-extensions>=4.9.0"
"$PY" -m pip install --quiet "$@" --no-deps "xgrammar>=0.2.8"
"$PY" -c "import xgrammar; xgrammar.Grammar.from_regex('[a-z]+')" \
  && echo "xgrammar installed (without triton)"
