#!/usr/bin/env bash
# Create the venv that runs NVIDIA kvpress for `atskv eval peer`:
#   bash benchmarks/peer_kvpress/setup.sh [VENV_DIR]   (default ~/.cache/atskv/venvs/kvpress)
# kvpress pins an older transformers than atskv, so it gets an environment of its own.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-${HOME}/.cache/atskv/venvs/kvpress}"
torch_cpu="${TORCH_CPU:-torch==2.13.0+cpu}"
torch_cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
if command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" torch
else
    "${pip[@]}" "$torch_cpu" 2>/dev/null || "${pip[@]}" --extra-index-url "$torch_cpu_index" "$torch_cpu"
fi
"${pip[@]}" -r "$here/requirements.txt"
"$venv/bin/python" -c "import kvpress, transformers, torch; print('kvpress venv ready:', '$venv', 'transformers', transformers.__version__, 'torch', torch.__version__)"
