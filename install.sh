#!/usr/bin/env bash
# Installs approx-run into ./.venv: torch (pinned by constraints.txt), the package and its compiled
# extension runner._C (CPU kernels; CUDA kernels too where torch has CUDA, nvcc exists and nvidia-smi sees a
# GPU, or where APPROX_RUN_NO_CUDA=0 asks for them: a login node building for its cluster's GPU nodes).
# Idempotent and quick when nothing changed: a stamp of the build inputs skips the rebuild.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$PY" -c "import torch, torchvision" 2>/dev/null; then
  echo "[install] torch + torchvision (constraints.txt)"
  pip_install -c constraints.txt torch torchvision
fi
"$PY" -c "import setuptools, wheel, ninja" 2>/dev/null || pip_install setuptools wheel ninja

# The CUDA kernels are most of a 2-core machine's build: without a GPU to run them, skip them unless asked.
if [ -z "${APPROX_RUN_NO_CUDA:-}" ]; then
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    export APPROX_RUN_NO_CUDA=0
  else
    export APPROX_RUN_NO_CUDA=1
    command -v nvcc > /dev/null && echo "[install] no GPU visible (nvidia-smi): CPU kernels only;" \
      "APPROX_RUN_NO_CUDA=0 ./install.sh builds the CUDA kernels too"
  fi
fi
stamp="$VENV/.approx-run-build"
# the choice is a build input: a second run that asks for the CUDA kernels builds them
inputs=$( (cat setup.py pyproject.toml $(find extensions -type f | sort); echo "no_cuda=$APPROX_RUN_NO_CUDA") \
  | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$inputs" ] || ! "$PY" -c "import torch, runner._C" 2>/dev/null; then
  echo "[install] approx-run + extension (a CUDA build takes a few minutes)"
  MAX_JOBS=${MAX_JOBS:-2} pip_install -c constraints.txt --no-build-isolation -e ".[test,sweep]"
  echo "$inputs" > "$stamp"
fi
# byte-compiled once here: where PYTHONDONTWRITEBYTECODE is set, every command would compile the sources again
"$PY" -m compileall -q runner > /dev/null
"$VENV/bin/approx-run" info
