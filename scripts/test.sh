#!/usr/bin/env bash
# Install everything, then run the test suite (all tests, the real-model ones included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` for the fast set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The optional xgrammar backend too, so its tests run rather than skip.
bash scripts/install_xgrammar.sh >/dev/null
PY="${PYTHON:-python3}"
exec "$PY" -m pytest -q -ra --durations=20 "$@"
