#!/usr/bin/env bash
# Create the virtualenv and install the project with its dev and train extras.
# torch: a CPU wheel is preferred. `pip install torch` with no pin pulls a multi-GB CUDA
# build, so when the venv has no torch yet we install the CPU build explicitly: from a local
# wheel directory when one exists (PIP_FIND_LINKS / /opt/wheels), else from PyTorch's CPU index.
set -euo pipefail
venv=${1:-.venv}
py=${PY:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then
    "${pip[@]}" install "$wheel"
  else
    "${pip[@]}" install torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"${pip[@]}" install -e ".[dev,train]"
echo "virtualenv ready: $venv"
