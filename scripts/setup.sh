#!/usr/bin/env bash
# Create (or refresh) .venv with subnetdp and its pinned dependencies. Idempotent and quick when
# nothing changed. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.subnetdp-setup"
want=$(cat pyproject.toml ci/constraints.txt | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up $VENV (torch, torchvision, mpich, transformers, lm-eval ... pinned by ci/constraints.txt)" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c ci/constraints.txt -e '.[dev,hf,eval]'
echo "$want" > "$stamp"
