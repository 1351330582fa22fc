#!/usr/bin/env bash
# On the GPU machine:
#   bash scripts/gpu_amp.sh            # amp's GPU tests, then the amp training benchmark (about 7 minutes on an H200)
#   bash scripts/gpu_amp.sh overhead   # the demo's amp workload: Trainer O2 + compile (checks deferred, and read
#                                      # every step) against the hand loop, with and without one host read per step
#                                      # (run 2026-12-05 on the H200 with --levels O2, about 5 minutes:
#                                      # benchmarks/results/train_overhead_cuda_compile_demo)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
if [ "${1:-}" = overhead ]; then
  PYTHONUNBUFFERED=1 timeout 540 python3 benchmarks/train_overhead.py --device cuda --compile --model demo \
      --levels O2,O1 --steps 11 --epochs 6 2>&1 | tee ${OUT:-/tmp}/train_overhead_demo.log
  [ -n "${OUT:-}" ] && cp benchmarks/results/train_overhead_cuda_compile_demo.* "$OUT"/ 2>/dev/null
  exit 0
fi
python3 -m pytest -q -m gpu tests/amp 2>&1 | tee ${OUT:-/tmp}/amp_gpu_tests.log
PYTHONUNBUFFERED=1 python3 benchmarks/amp_train.py "$@" 2>&1 | tee ${OUT:-/tmp}/amp_train.log
