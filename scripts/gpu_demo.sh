#!/usr/bin/env bash
# `overdrive demo` on a GPU machine, default flags (the workload sized for the GPU), then the demo's gpu
# tests (the --quick demo through every stage). Results: benchmarks/results/demo_gpu/ (report.md, its
# PNG charts, report.json) and benchmarks/results/demo_gpu.json; with $OUT set they are copied there too.
#   bash scripts/gpu_demo.sh          # demo + gpu tests (the demo took about 7 minutes on 2026-12-04: run
#                                     # `bash scripts/gpu_demo.sh demo` and `... tests` as two calls)
#   bash scripts/gpu_demo.sh demo     # the demo only
#   bash scripts/gpu_demo.sh tests    # gpu tests only
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
res=benchmarks/results
rc=0
marker=$(mktemp)
if [ "${1:-all}" != tests ]; then
  mkdir -p "$res/demo_gpu"
  timeout "${DEMO_LIMIT_S:-560}" python3 -m overdrive.cli.main demo --device cuda --no-progress \
      --report "$res/demo_gpu" --json "$res/demo_gpu.json" 2>&1 | tee "${OUT:-/tmp}/demo_gpu.log" \
      | grep -E "^stage '|^demo:|error|Error|^report"
  rc=${PIPESTATUS[0]}  # the demo's own status (124: the time limit), not grep's
  echo "demo exit code: $rc"
  if [ -n "${OUT:-}" ] && [ "$res/demo_gpu.json" -nt "$marker" ]; then  # this run's report, not an old one
    cp "$res"/demo_gpu/* "$OUT"/ 2>/dev/null; cp "$res/demo_gpu.json" "$OUT"/ 2>/dev/null
  fi
fi
[ "${1:-all}" = demo ] && exit "$rc"
timeout "${TESTS_LIMIT_S:-240}" python3 -m pytest -q -m gpu tests/demo tests/data/test_gpu.py tests/quant/test_export_arith.py tests/quant/test_real.py tests/distributed/test_gpu.py \
    -p no:cacheprovider 2>&1 | tail -5
exit "$rc"
