#!/usr/bin/env bash
# The main job: install, start sglite on the default model and run an example LM program on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY="${PYTHON:-python3}"
exec "$PY" examples/quickstart.py "$@"
