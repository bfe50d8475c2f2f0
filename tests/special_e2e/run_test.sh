#!/usr/bin/env bash
# End-to-end checks outside pytest.
#   tests/special_e2e/run_test.sh --distributed-vs-single [--world 2|4 ...] [--steps K]
# runs `scalerl verify distributed-vs-single`: K GRPO and SFT steps single-process and under each parallel
# layout (gloo on CPU), comparing per-step losses and final weights; exits non-zero on any mismatch.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
case "${1:-}" in
  --distributed-vs-single)
    shift
    export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
    exec "$PY" -m scalerl verify distributed-vs-single "$@"
    ;;
  *)
    echo "usage: $0 --distributed-vs-single [--world 2|4 ...] [--steps K] [--output-dir DIR]" >&2
    exit 2
    ;;
esac
