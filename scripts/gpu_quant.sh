#!/usr/bin/env bash
# GPU run for overdrive.quant: the gpu tests, then the full benchmark (budget: <= 4 minutes on one H200).
#   bash scripts/gpu_quant.sh            # results in benchmarks/results/quant.{json,md}; copied to $OUT if set
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
python3 -m pytest -q -m gpu tests/quant || echo "gpu tests FAILED (continuing to the benchmark)"
python3 benchmarks/quant.py
echo "gpu_quant.sh took $(( $(date +%s) - start )) s"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp benchmarks/results/quant.json benchmarks/results/quant.md "$OUT/"
fi
