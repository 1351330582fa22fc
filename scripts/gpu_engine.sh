#!/usr/bin/env bash
# GPU run for overdrive.engine on the lent H200 (about 8 minutes): gpu tests; the batch-256 engines
# (fp16, fp8, int8) timed and kernel-profiled next to eager (benchmarks/results/engine_profile_quant.*);
# then batch 1 with freezing (benchmarks/results/engine.*). Each step has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/engine -p no:cacheprovider 2>&1 | tail -15 || echo "gpu tests FAILED or timed out"
echo "tests took $(( $(date +%s) - start )) s"
timeout 200 python3 benchmarks/engine_profile.py --models resnet50 --engines-only --engines fp16,fp8,int8 --engine-io fp16:hwc \
    --name engine_profile_quant 2>&1 | grep "^{\|^profile\|^  top\|Error" || echo "engine_profile (resnet50) timed out or failed"
timeout 150 python3 benchmarks/engine_profile.py --models bert --engines-only --engines bf16,fp8 --name engine_profile_quant_bert \
    2>&1 | grep "^{\|^profile\|^  top\|Error" || echo "engine_profile (bert) timed out or failed"
timeout 120 python3 benchmarks/engine.py --batches 1 --precisions fp16,bf16 --budget-s 90 2>&1 | grep "|\|^- \|wrote" \
    || echo "engine.py timed out or failed"
echo "total $(( $(date +%s) - start )) s"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp benchmarks/results/engine.json benchmarks/results/engine.md benchmarks/results/engine_profile_quant*.* "$OUT"/ 2>/dev/null || true
fi
