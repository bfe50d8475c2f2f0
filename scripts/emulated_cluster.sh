#!/usr/bin/env bash
# An emulated multi-node cluster on this machine: network namespaces as nodes, tc-shaped links between
# them (scalerl/launch/emulated_cluster.py). Needs root and iproute2. Examples:
#   scripts/emulated_cluster.sh --nodes 2 --ranks-per-node 2 --rate-mbit 200 -- python my_script.py
#   scripts/emulated_cluster.sh --cleanup    # remove namespaces and links left by killed runs
# Python: $PYTHON, else the repository's .venv, else python3.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
[ -x "$python" ] || python=python3
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m scalerl.launch.emulated_cluster "$@"
