# Sourced (not run) by the GPU scripts (gpu_session.sh, ddp_gpu.sh) from the repository root: the device
# image's missing packages from the wheels in .whl (hydra, omegaconf, mlxtend: ../shared/tools/device-wheels.sh),
# optional bytecode caching, and the extension's CUDA build. Needs $out (logs); sets $t0 (the build's start).
#
# BUILD=always (the default): build, as a change's verification must. BUILD=auto: skip the build when runner/_C
# already loads with its CUDA kernels here (built by an earlier call on a machine still warm, or its .so brought
# back from one and carried): a benchmark of the same tree then starts about 2 minutes sooner.
# CACHE_BYTECODE=1: compile torch's and the package's sources once, under /tmp/pyc, as a pip install does.
# The device image sets PYTHONDONTWRITEBYTECODE and ships torch without bytecode, so otherwise every process
# compiles torch again: about 1.5 s of `import torch` and 2 s of a 19-table sweep on an H100
# (benchmarks/README.md). Quote command wall times with the setting they were measured under.
export PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "${CACHE_BYTECODE:-0}" = 1 ]; then
  export PYTHONPYCACHEPREFIX=/tmp/pyc
  unset PYTHONDONTWRITEBYTECODE
  # best effort: a few of torch's files do not compile under every Python (compileall then exits 1)
  python3 -m compileall -q -j 0 "$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')" runner \
    > /dev/null
fi
t0=$SECONDS
if [ "${BUILD:-always}" = auto ] && python3 -c "import sys; from runner._ext import backend_status; \
sys.exit(backend_status()['cuda'] != 'available')" 2>/dev/null; then
  echo "build: skipped (BUILD=auto: runner/_C loads with its CUDA kernels)"
else
  TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
    python3 -m pip install -q --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; return 1; }
  echo "build: $((SECONDS - t0)) s"
fi
python3 -m runner.cli info | tail -8
