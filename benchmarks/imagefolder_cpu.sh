#!/usr/bin/env bash
# The ImageNet workflow's commands on a CPU, rehearsed on the generated ImageFolder tree of the tests
# (tests/data/imagefolder_fixture.py: 10 classes, 3 images a class in train/ and val/, JPEG and PNG, odd sizes,
# grayscale, CMYK, a palette PNG, one damaged JPEG) with four torchvision architectures, each from a state dict
# of seeded random weights for 10 classes (timing and exact-vs-fake-quant agreement do not depend on the
# weights). 32x32 crops keep each architecture's command set to a minute or two on two cores.
#
#     bash benchmarks/imagefolder_cpu.sh                 # all four; logs and summary.txt under $OUT
#     ARCHS="resnet18 convnext_tiny" bash benchmarks/imagefolder_cpu.sh
#
# Each command is its own process (imports and the data cache as a user's would be); summary.txt has one line
# per command: its exit code, wall and CPU time and the load average when it ended. What each should show:
#   compare_bad   exit 2 naming val/n00000004/broken.jpg, nothing cached
#   compare       data.skip_bad=true: "skipped 1 damaged val image"; the approx row's agreement_fakequant 1.000
#                 over 30 images (the exact table gives fake-quant's prediction on every image)
#   sweep         2 tables; this and every later command says "using cache ... decoded nothing"
#   sensitivity   2 layers x 2 tables
#   search        estimated on data.limit=20 images a split, confirmed on the whole val split ("on 30 images")
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/imagefolder-cpu}
py=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
mkdir -p "$out"
rm -rf "$out/results" "$out/checkpoints"
: > "$out/summary.txt"
archs=${ARCHS:-resnet18 mobilenet_v3_small efficientnet_b0 convnext_tiny}

"$py" - "$out" $archs <<'PY' || exit 1
import sys
from pathlib import Path

import torch

from runner.models.torchvision_models import build
from tests.data.imagefolder_fixture import write_imagefolder

out = Path(sys.argv[1])
if not (out / "tree").exists():
    write_imagefolder(out / "tree", per_class=3)
for arch in sys.argv[2:]:
    torch.manual_seed(0)
    torch.save(build(arch, num_classes=10).state_dict(), out / f"{arch}.pt")
PY

declare -A layers=([resnet18]="[layer4.1.conv2,fc]" [mobilenet_v3_small]="[classifier.0,classifier.3]"
                   [efficientnet_b0]="[features.8.0,classifier.1]" [convnext_tiny]="[features.7.2.block.5,classifier.2]")
tables="[mul8s_1L2J,mul8s_1L12]"  # signed: MobileNetV3's and EfficientNet's activations go negative
echo "$(getconf _NPROCESSORS_ONLN) cores, OMP_NUM_THREADS=$OMP_NUM_THREADS, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" \
  >> "$out/summary.txt"
for arch in $archs; do
  M="model=torchvision model.arch=$arch model.weights=$out/$arch.pt +model.num_classes=10 data=imagefolder
     data.root=$out/tree data.resize=40 data.crop=32 data.workers=1 eval.repeats=1 eval.warmup=0
     paths.results=$out/results paths.checkpoints=$out/checkpoints"
  step() {  # wall and CPU (user + sys) seconds: on a shared machine the CPU time is the steadier number
    local name=$1; shift
    local TIMEFORMAT="%R %U %S" took rc
    took=$( { time $py -m runner.cli "$@" > "$out/${arch}_$name.log" 2>&1; echo "rc=$?" >&2; } 2>&1 )
    rc=$(echo "$took" | grep -o 'rc=[0-9]*')
    read -r wall user sys <<< "$(echo "$took" | grep -v rc=)"
    printf "%-20s %-12s %s wall %6.1fs cpu %6.1fs load %s\n" "$arch" "$name" "$rc" "$wall" \
      "$(echo "$user + $sys" | bc)" "$(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/summary.txt"
  }
  step compare_bad compare $M multiplier=exact
  step compare compare $M data.skip_bad=true multiplier=exact
  step sweep sweep $M data.skip_bad=true "sweep.multipliers=$tables"
  step sensitivity sensitivity $M data.skip_bad=true "sensitivity.multipliers=$tables" "sensitivity.layers=${layers[$arch]}"
  step search search $M data.skip_bad=true data.limit=20 "search.multipliers=$tables" \
    "search.layers=${layers[$arch]}" search.max_evals=4 search.max_loss=5
done
cat "$out/summary.txt"
