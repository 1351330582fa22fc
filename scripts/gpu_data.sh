#!/usr/bin/env bash
# overdrive.data on the GPU machine: GPU tests, then the full benchmark (about 2 minutes; budget 4).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
python3 -m pytest -q -m gpu tests/data || status=$?
python3 benchmarks/data.py "$@" || status=$?
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp benchmarks/results/data.json benchmarks/results/data.md "$OUT/" 2>/dev/null || true
fi
exit $status
