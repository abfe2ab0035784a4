#!/usr/bin/env bash
# Set up .venv (pinned) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest "$@"
