#!/usr/bin/env bash
# GPU run for overdrive.sparsity on the H200: gpu tests, then the speed benchmark (full mode).
# Expected: about 2-3 minutes. Results go to benchmarks/results/sparsity.{json,md} and $OUT/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
python3 -m pytest -q -m gpu tests/sparsity 2>&1 | tee /tmp/sparsity_gpu_tests.log || status=$?
python3 benchmarks/sparsity.py 2>&1 | tee /tmp/sparsity_bench.log || status=$?
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp benchmarks/results/sparsity.json benchmarks/results/sparsity.md "$OUT/" 2>/dev/null || true
  cp /tmp/sparsity_gpu_tests.log /tmp/sparsity_bench.log "$OUT/" 2>/dev/null || true
fi
exit $status
