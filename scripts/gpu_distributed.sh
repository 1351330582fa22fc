#!/usr/bin/env bash
# Single-GPU checks for overdrive.distributed (NCCL under torchrun, doctor + bandwidth, DDP/FSDP O2 bf16).
# Budget: about 90 s on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
python3 -m pytest -q -m gpu tests/distributed
python3 -m overdrive.cli.main doctor --bandwidth 1 --max-bytes $((256 * 1024 * 1024)) --json > /tmp/overdrive_doctor.json || true
python3 - <<'PY'
import json; r = json.load(open("/tmp/overdrive_doctor.json"))
print("doctor:", r["versions"], "| findings:", [f["detail"] for f in r["findings"]])
for row in r["bandwidth"]["rows"][-3:]: print(row)
PY
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; cp /tmp/overdrive_doctor.json "$OUT/doctor_1gpu.json"; fi
