#!/usr/bin/env bash
# The trainer's GPU check: one CUDA GPU, about 5 minutes. From the repository root:
#
#   bash scripts/checks/gpu_wheels.sh        # here, with network: wheels the GPU machine lacks (.whl/)
#   bash scripts/checks/gpu_check.sh [OUT] [--steps N] [--no-sdpa] [--no-dflash2] [--no-shard] [--long-seq N]   # there: figures to stdout and
#                                     # OUT/gpu_check.json
#
# Needs python3 with torch (CUDA), transformers, pyarrow, msgpack, click and numpy; pyzmq is
# installed from .whl/ when missing (nothing is downloaded), and the two C extensions are
# compiled in place with the machine's C compiler. Every stage writes its figures as soon as
# it has them, so a later failure keeps the earlier numbers.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-${OUT:-gpu-check-out}}
shift || true
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

if ! python3 -c "import zmq" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "pyzmq is missing and .whl/ holds no wheels: run scripts/checks/gpu_wheels.sh first" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/dflash-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/dflash-site${PYTHONPATH:+:$PYTHONPATH}
fi

# The daemon's fill and the ring counters: compiled here, in place, as pip would.
inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
cc=${CC:-$(command -v gcc || command -v cc)}
"$cc" -O3 -shared -fPIC -I"$inc" loader_server/data/_native.c -o "loader_server/data/_native$suffix" || exit 1
"$cc" -O2 -shared -fPIC -I"$inc" loader_server/wire/_ring.c -o "loader_server/wire/_ring$suffix" || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

timeout --signal=INT 460 python3 scripts/checks/gpu_check.py --out "$OUT_DIR" "$@"
