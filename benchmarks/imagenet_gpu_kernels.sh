#!/usr/bin/env bash
# ImageNet shapes on the GPU (not yet run): torchvision resnet18 / resnet50 / mobilenet_v2 at 3x224x224,
# batch 64 and 256, the `cuda` backend's auto against cuDNN fp32 with TF32 off and on (CUDA events, medians
# of 10, alternated in one process), whole model and per layer with the fraction of the H100's lookup limit
# (8.4 T reads/s; the pairs layout reads two products per read). Needs torchvision on the device and a built
# runner._C (bash benchmarks/gpu_session.sh builds it). From the repository root:
#
#     bash benchmarks/imagenet_gpu_kernels.sh          # logs and per-layer CSVs under $OUT (or ./gpu-out)
#
# What it should show (the bars the kernels are measured against): per model, "ratio LUT / fp32 TF32 off"
# and "T MAC/s" (ResNet-50 >= 5 T MAC/s, i.e. <= 2.5x TF32-off cuDNN; ResNet-18 >= 5; MobileNetV2 >= 2.5);
# per layer, limit_fraction and gmacs (3x3 convs >= 6 T MAC/s, 1x1 >= 5, depthwise >= 2) and auto_pick.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for model in resnet18 resnet50 mobilenet_v2; do
  for batch in 64 256; do
    python3 benchmarks/imagenet.py --backend cuda --model $model --batch $batch --repeats 10 --layers \
      --csv "$out/imagenet_${model}_b${batch}_layers.csv" 2>&1 | tee "$out/imagenet_${model}_b${batch}.log" | grep -v "^ "
  done
done
