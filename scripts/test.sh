#!/usr/bin/env bash
# Set up .venv (pinned) and run the whole test suite. Extra arguments go to pytest.
# Two pytest-xdist workers: the tests that launch, kill, stall or signal process groups run one at a time on one of
# them, as they did alone (tests/conftest.py schedules them as one unit of work); the in-process tests run beside
# them on the other, on the core the spawning tests left idle about half of the time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
