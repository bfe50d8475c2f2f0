#!/usr/bin/env bash
# The GPU self-test (scripts/gpu_selftest.py): one line per CUDA / NCCL check, at most 5 minutes on one
# GPU, no downloads. Without CUDA the CUDA checks print SKIP with the reason and the script exits 0.
#   scripts/gpu_selftest.sh [--budget-s 300]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
python="${PYTHON:-python}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
exec timeout --signal=INT 330 "$python" "$here/gpu_selftest.py" "$@"
