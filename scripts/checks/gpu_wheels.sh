#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86-64, no network): what its image lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl 'pyzmq>=25'
ls -l .whl
