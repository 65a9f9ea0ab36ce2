#!/usr/bin/env bash
# Create the venv that runs NVIDIA kvpress for `atskv eval peer`:
#   bash benchmarks/peer_kvpress/setup.sh [VENV_DIR]   (default ~/.cache/atskv/venvs/kvpress)
# kvpress pins an older transformers than atskv, so it gets an environment of its own.
# Everything installs from the package index (and find-links) pip is configured with, nothing else.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-${HOME}/.cache/atskv/venvs/kvpress}"
torch_cpu="${TORCH_CPU:-torch==2.13.0+cpu}"
torch_any="${TORCH:-torch==2.13.0}"

python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" torch
else
    # the CPU build where the configured index has it, else the torch it has
    "${pip[@]}" "$torch_cpu" 2>/dev/null || "${pip[@]}" "$torch_any"
fi
"${pip[@]}" -r "$here/requirements.txt"
"$venv/bin/python" -c "import kvpress, transformers, torch; print('kvpress venv ready:', '$venv', 'transformers', transformers.__version__, 'torch', torch.__version__)"
