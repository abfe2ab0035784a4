#!/usr/bin/env bash
# Set up .venv and run the default job: ResNet-18 with block-level SDP (coverage 0.5) on
# scikit-learn's digits, 4 local workers. Extra key=value arguments override the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/subnetdp train resnet18_digits "$@"
