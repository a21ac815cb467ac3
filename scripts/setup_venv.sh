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
# The Mooncake store (--states-transport mooncake, and its tests) loads Debian's RDMA
# libraries even for TCP: install them where they are missing and we may.
if ! "$venv/bin/python" -c "import mooncake.store" 2>/dev/null; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null 2>&1 ||
      { apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null; } ||
      echo "setup: could not install libibverbs1 librdmacm1 (Mooncake needs them)"
  else
    echo "setup: Mooncake needs Debian's libibverbs1 and librdmacm1: sudo apt-get install libibverbs1 librdmacm1"
  fi
fi
"$venv/bin/python" -c "import mooncake.store" || { echo "setup: mooncake.store does not import"; exit 1; }
echo "virtualenv ready: $venv"
