#!/usr/bin/env bash
# One job over 4 GPUs against 1 (docs/distributed.md): a DDP retraining epoch of torchvision ResNet-18 on
# generated 224x224 ImageFolder data, ResNet-8 retrained on Fashion-MNIST (accuracy), the 8-table x 5-epoch
# Fashion-MNIST retraining sweep, and a sharded exact-table evaluation of torchvision ResNet-50. Wall seconds
# of whole commands, each into a fresh results directory; baselines first, untimed.
#
#   bash benchmarks/ddp_gpu.sh /path/to/fashion-mnist [out dir]     # on a 4-GPU host, from the repo root
#   IMAGES=5000 bash benchmarks/ddp_gpu.sh /data/fmnist              # quicker: fewer generated images
#   ONLY=resnet18,eval50 bash benchmarks/ddp_gpu.sh /data/fmnist     # some parts: resnet18 resnet8 sweep eval50
#
# Bars: the ResNet-18 epoch (finetune_epoch_s) >= 3.2x faster on 4 GPUs than on 1; ResNet-8 on 4 GPUs within
# 0.5 points of 1 GPU; the sweep >= 3x faster on 4 GPUs; the ResNet-50 evaluation of 50,000 images >= 3.3x
# faster (testset_ms_median, and the whole command) with the same correct / accuracy / row_key.
#
# Assumes the torchvision models (model=torchvision model.arch=...) and ImageFolder data (data=imagefolder
# data.root=DIR, DIR/train/<class>/*.png and DIR/val/<class>/*.png) of the branches that add them.
set -euo pipefail
FMNIST=${1:?usage: bash benchmarks/ddp_gpu.sh FASHION_MNIST_DIR [OUT_DIR]}
OUT=${2:-/tmp/approx-run-ddp}
PY=${PYTHON:-python3}
N=${IMAGES:-50000}
ONLY=${ONLY:-resnet18,resnet8,sweep,eval50}
CKPT="$OUT/checkpoints"
IMG="$OUT/images$N"
TABLES8='mul8s_1L2J,mul8s_1L2N,mul8s_1L12,mul8s_1KXF,mul8u_17C8,mul8u_T83,mul8u_18UH,mul8u_1A0M'
mkdir -p "$OUT"
want() { [[ ",$ONLY," == *",$1,"* ]]; }

"$PY" - <<'EOF'
import os, platform, torch
print(f"host: {platform.node()}  GPUs: {torch.cuda.device_count()} "
      f"({', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))})  "
      f"CPU cores: {os.cpu_count()}  torch {torch.__version__}")
EOF

# One timed command (wall seconds, process start to return); its results directory is $OUT/<label>.
timed() {
  local label=$1; shift
  rm -rf "$OUT/$label"
  local t0=$EPOCHREALTIME
  "$PY" -m runner.cli "$@" "paths.results=$OUT/$label" "paths.checkpoints=$CKPT" >"$OUT/$label.log" 2>&1 \
    || echo "  $label: exit $? (log $OUT/$label.log)"
  "$PY" -c "print(f'{\"$1 $label\":<40} {$EPOCHREALTIME - $t0:8.2f} s wall')"
}

# columns of the rows of one path in a results directory
rows() {
  "$PY" - "$@" <<'EOF'
import sys
import pandas as pd
root, path, cols = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
df = pd.read_csv(f"{root}/results.csv")
print(df[df["path"] == path][[c for c in cols if c in df.columns]].to_string(index=False))
EOF
}

if want resnet18 || want eval50; then
  if [ ! -d "$IMG/train" ]; then
    echo "== generating $N 224x224 images in 10 classes under $IMG (train/ and val/ the same files)"
    "$PY" - "$IMG" "$N" <<'EOF'
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
import numpy as np
from PIL import Image

root, n = Path(sys.argv[1]), int(sys.argv[2])

def make(i):
    rng = np.random.default_rng(i)
    c = i % 10
    # a class-dependent colour cast over noise: learnable, not trivial
    img = (rng.integers(0, 160, (224, 224, 3)) + np.array([c * 9, 90 - c * 9, (c * 37) % 90])).clip(0, 255)
    path = root / "train" / f"class{c}" / f"{i:06d}.png"
    Image.fromarray(img.astype(np.uint8)).save(path, compress_level=1)

for c in range(10):
    (root / "train" / f"class{c}").mkdir(parents=True, exist_ok=True)
with ProcessPoolExecutor() as pool:
    list(pool.map(make, range(n), chunksize=256))
(root / "val").symlink_to(root / "train")
EOF
  fi
fi

if want resnet18; then
  echo "== torchvision ResNet-18, ImageFolder $N images, one retraining epoch, global batch 256, exact table"
  r18=(finetune model=torchvision model.arch=resnet18 data=imagefolder "data.root=$IMG" backend=cuda
       multiplier=exact finetune.epochs=1 finetune.batch_size=256 finetune.force=true eval.limit=1000 eval.repeats=1)
  "$PY" -m runner.cli train model=torchvision model.arch=resnet18 data=imagefolder "data.root=$IMG" \
    "paths.checkpoints=$CKPT" "paths.results=$OUT/train" >"$OUT/train_r18.log" 2>&1 || echo "  baseline: see $OUT/train_r18.log"
  timed r18_1gpu "${r18[@]}"
  timed r18_4gpu "${r18[@]}" finetune.devices=4
  for l in r18_1gpu r18_4gpu; do
    rows "$OUT/$l" approx_finetuned finetune_world_size,finetune_devices,finetune_batch_per_device,finetune_epoch_s,accuracy
  done
  echo "   bar: finetune_epoch_s of 1 GPU / 4 GPUs >= 3.2"
fi

if want resnet8; then
  echo "== ResNet-8, Fashion-MNIST, mul8u_T83, default recipe (5 epochs, global batch 64)"
  r8=(finetune model=resnet8 data=fashion_mnist "data.root=$FMNIST" backend=cuda multiplier=mul8u_T83 finetune.force=true)
  "$PY" -m runner.cli train model=resnet8 data=fashion_mnist "data.root=$FMNIST" "paths.checkpoints=$CKPT" \
    "paths.results=$OUT/train" >"$OUT/train_r8.log" 2>&1
  timed r8_1gpu "${r8[@]}"
  timed r8_4gpu "${r8[@]}" finetune.devices=4
  for l in r8_1gpu r8_4gpu; do
    rows "$OUT/$l" approx_finetuned finetune_world_size,finetune_batch_per_device,finetune_epoch_s,accuracy
  done
  echo "   bar: the two accuracies within 0.5 points"
fi

if want sweep; then
  echo "== Fashion-MNIST sweep, 8 tables x 5 epochs (the default recipe), one GPU per job"
  "$PY" -m runner.cli train data=fashion_mnist "data.root=$FMNIST" "paths.checkpoints=$CKPT" \
    "paths.results=$OUT/train" >"$OUT/train_fm.log" 2>&1
  fm=(sweep "sweep.multipliers=$TABLES8" data=fashion_mnist "data.root=$FMNIST" backend=cuda finetune.epochs=5
      finetune.force=true)
  timed sweep8_1gpu "${fm[@]}" 'sweep.devices=[cuda:0]'
  timed sweep8_4gpu "${fm[@]}" sweep.devices=auto
  echo "   bar: wall of 1 GPU / 4 GPUs >= 3"
fi

if want eval50; then
  echo "== torchvision ResNet-50, exact table, evaluation of $N images, batch 256"
  r50=(compare model=torchvision model.arch=resnet50 data=imagefolder "data.root=$IMG" backend=cuda multiplier=exact
       eval.batch_size=256 eval.warmup=1 eval.repeats=1)
  "$PY" -m runner.cli train model=torchvision model.arch=resnet50 data=imagefolder "data.root=$IMG" \
    "paths.checkpoints=$CKPT" "paths.results=$OUT/train" >"$OUT/train_r50.log" 2>&1 || echo "  baseline: see $OUT/train_r50.log"
  timed r50_1gpu "${r50[@]}"
  timed r50_4gpu "${r50[@]}" eval.devices=4
  for l in r50_1gpu r50_4gpu; do
    rows "$OUT/$l" approx n_images,correct,accuracy,agreement_fakequant,row_key,testset_ms_median,eval_world_size,eval_devices
  done
  echo "   bar: the same correct / accuracy / row_key; testset_ms_median (and wall) of 1 GPU / 4 GPUs >= 3.3"
fi
