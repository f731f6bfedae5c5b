#!/usr/bin/env bash
# The GPU verification of one change, in as few device calls as a lease allows. On the GPU machine, from
# the repository root (its image has torch, pandas, rich, pytest; hydra, omegaconf and mlxtend come as
# wheels made here by ../shared/tools/device-wheels.sh mlxtend, carried in .whl):
#
#     bash benchmarks/gpu_session.sh check    # build, every CUDA test, compute-sanitizer memcheck
#     bash benchmarks/gpu_session.sh speed    # per-layer and whole-model times, training epochs, sweep wall time
#     bash benchmarks/gpu_session.sh all      # both, one build (about 6 minutes on an H100 host)
#     FMNIST=DIR bash benchmarks/gpu_session.sh agree     # every shipped table on Fashion-MNIST (IDX files in DIR):
#                                                         # cpp vs cuda predictions, then retraining time and accuracy
#
# Logs and tables go to $OUT (or ./gpu-out); the last lines of each step are the figures to quote.
# The set-up (wheels, CACHE_BYTECODE=1, the build) is benchmarks/gpu_setup.sh's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
source benchmarks/gpu_setup.sh || exit 1

step() { echo "== $1"; shift; "$@"; echo "   (rc $?, $((SECONDS - t0)) s)"; }

mode=${1:-check}
case $mode in check|all)
  step "CUDA tests" bash -c "python3 -m pytest -m cuda -q -p no:cacheprovider tests/ops tests/test_layers.py \
    tests/test_layers_training.py tests/reliability/test_numeric.py tests/test_graphs.py 2>&1 | tee '$out/cuda_tests.log' | tail -4"
  step "memcheck" bash -c "compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/cuda_memcheck.py \
    > '$out/memcheck.log' 2>&1; tail -3 '$out/memcheck.log'"
  step "memcheck quantize" bash -c "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
    --error-exitcode 1 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ops/test_quant_ops.py \
    > '$out/memcheck_quant.log' 2>&1; tail -3 '$out/memcheck_quant.log'"
  ;;
esac
case $mode in agree)
  fm="data=fashion_mnist data.root=${FMNIST:?FMNIST=<dir of the four IDX .gz files>} paths.checkpoints=/tmp/ckpt"
  step "sweep cuda" bash -c "python3 -m runner.cli sweep 'sweep.multipliers=mul8*' backend=cuda $fm paths.results=/tmp/r_cuda \
    > '$out/sweep_cuda.log' 2>&1; tail -3 '$out/sweep_cuda.log'"
  step "sweep cpp" bash -c "python3 -m runner.cli sweep 'sweep.multipliers=mul8*' backend=cpp $fm paths.results=/tmp/r_cpp \
    > '$out/sweep_cpp.log' 2>&1; tail -3 '$out/sweep_cpp.log'"
  step "cpp vs cuda" bash -c "python3 benchmarks/backend_agreement.py /tmp/r_cpp/sweep/* /tmp/r_cuda/sweep/* | tee '$out/agreement.log' | tail -8;
    cp /tmp/r_cuda/sweep/*/summary.csv '$out/fmnist_sweep_cuda.csv'; cp /tmp/r_cuda/results.csv '$out/fmnist_results_cuda.csv'"
  for m in ${FINETUNE_TABLES-mul8u_T83 mul8s_1L2N}; do   # FINETUNE_TABLES="" skips the retraining
    step "finetune $m" bash -c "python3 -m runner.cli finetune multiplier=$m backend=cuda $fm paths.results=/tmp/r_ft \
      > '$out/finetune_$m.log' 2>&1; grep -i 'retrain\|epoch\|finetuned' '$out/finetune_$m.log' | tail -6"
  done
  ;;
esac
case $mode in speed|all)
  step "layers" bash -c "python3 benchmarks/cuda_layers.py --repeat 30 --algos auto --out '$out/layers.json' 2>&1 \
    | tee '$out/layers.log' | tail -14"
  step "conv ends: one op against lut_conv2d and the end's op" bash -c "python3 benchmarks/fused_end.py --shapes r50,r50k \
    --batch 64 2>&1 | tee '$out/fused_end.log' | tail -60"
  step "1x1 and 3x3 convs: auto's GEMM layout against every variant on the shapes as given" bash -c "python3 \
    benchmarks/gemm_layout.py --batches 1,8,32,64,256 2>&1 | tee '$out/gemm_layout.log' | tail -76"
  step "ResNet-50's convs on the codes they get: auto against every variant on the shapes as given" bash -c \
    "python3 benchmarks/gemm_layout.py --model resnet50 --batches 64 --repeat 10 2>&1 | tee '$out/gemm_layout_r50.log'"
  step "zoo at batch 1,000, eager and graphed" bash -c "python3 benchmarks/zoo_gpu.py --models lenet5,resnet20 \
    --layer-batches 1000 --model-batches 1000 --algos auto --out '$out/zoo' 2>&1 | grep -E '^(lenet5|resnet20) ' \
    | tee '$out/zoo.log'"
  step "attention matmuls" bash -c "python3 benchmarks/cuda_attention.py --repeat 30 --out '$out/attention.json' 2>&1 \
    | tee '$out/attention.log' | tail -34"
  step "model + training" bash -c "python3 -m runner.cli bench bench.backends=[cuda] bench.ops=false \
    bench.train_batch_size=32 2>&1 | tee '$out/bench.log' | tail -30"
  # the image sets PYTHONDONTWRITEBYTECODE: a user's install keeps its bytecode, so the timing does too
  step "exploration" env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc bash -c "python3 benchmarks/dse_speed.py --backend cuda --checkpoints /tmp/ckpt --repeats 5 \
    --commands sweep 2>&1 | tee '$out/dse.log' | tail -6"
  ;;
esac
