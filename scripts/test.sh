#!/usr/bin/env bash
# Set up .venv (pinned) and run the whole test suite. Extra arguments go to pytest.
# Two pytest-xdist workers: the single-process tests use one core each (the quick tier takes about half
# the time), while the tests that spawn process groups stay in one group, run in order on one worker
# (tests/conftest.py). TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
