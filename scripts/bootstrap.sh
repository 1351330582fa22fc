#!/usr/bin/env bash
# Install overdrive with an extra ("demo", "test", ...) on a fresh machine.
# Installs the CPU build torch==2.13.0 first when torch is absent, so that pip never pulls a
# multi-GB CUDA build to satisfy `torch>=2.11`. Where torch is already installed (any build,
# CUDA included) it is kept.
set -euo pipefail
extra="${1:-demo}"
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
    "$py" -m pip install -q torch==2.13.0
fi
"$py" -m pip install -q -e ".[${extra}]"
