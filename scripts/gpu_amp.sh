#!/usr/bin/env bash
# On the GPU machine: amp's GPU tests, then the amp training benchmark (about 7 minutes on an H200).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
python3 -m pytest -q -m gpu tests/amp 2>&1 | tee ${OUT:-/tmp}/amp_gpu_tests.log
PYTHONUNBUFFERED=1 python3 benchmarks/amp_train.py "$@" 2>&1 | tee ${OUT:-/tmp}/amp_train.log
