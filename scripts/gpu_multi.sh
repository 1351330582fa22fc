#!/usr/bin/env bash
# Multi-GPU benchmark (issue 8): DDP / FSDP2 throughput on 1,2,4,8 GPUs (as many as present) for
# ResNet-50 bs256/GPU and GPT-2 small at O2 bf16, plus all_reduce busbw 8 KiB - 4 GiB.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
# Expected: ~1.5-2.5 min per GPU count (torchrun start + 6 configs x 25 steps) + ~1 min bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m overdrive.cli.main doctor --json > benchmarks/results/distributed_doctor.json || true
python3 benchmarks/distributed.py "$@"
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; cp benchmarks/results/distributed.* benchmarks/results/distributed_doctor.json "$OUT/"; fi
