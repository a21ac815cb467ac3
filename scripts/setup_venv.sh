#!/usr/bin/env bash
# Create the virtualenv and install the project with its dev and train extras.
# torch: a CPU wheel is preferred. `pip install torch` with no pin pulls a multi-GB CUDA
# build, so when the venv has no torch yet we install the CPU build explicitly: from a local
# wheel directory when one exists (/opt/wheels), else from PyTorch's CPU index.
# The installer is uv, put into the venv by pip: it fetches and unpacks in parallel and
# resolves to the same versions pip does (about 35 s for the whole set on a 2-core VM
# against pip's 95 s, docs/TESTING.md). pip installs everything where uv cannot be had.
# Bytecode is compiled at install (uv's --compile-bytecode, pip's default): where Python is
# told not to write it (PYTHONDONTWRITEBYTECODE), a package installed without it is
# compiled again by every process that imports it (torch: about 2.9 s an import, not 1.5).
set -euo pipefail
venv=${1:-.venv}
py=${PY:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if "${pip[@]}" install uv >/dev/null 2>&1 && [ -x "$venv/bin/uv" ]; then
  install=("$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python")
else
  echo "setup: uv could not be installed; installing with pip"
  install=("${pip[@]}" install)
fi
wanted=(-e ".[dev,train]")
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$wheel" ]; then
    wanted=("$wheel" "${wanted[@]}")
  else
    "${install[@]}" torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"${install[@]}" "${wanted[@]}"
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
