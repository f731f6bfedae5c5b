#!/usr/bin/env bash
# The ImageNet-scale bars on one H100 (16 cores), without ImageNet or a network: 50,000 generated
# ImageNet-sized JPEGs in 1000 synset-named class folders, ResNet-50 with random weights saved as a state
# dict (the weights enum's file cannot be downloaded there; timing and exact-vs-fake-quant agreement do not
# depend on the weights). From the repository root on the GPU machine (as benchmarks/gpu_session.sh: the
# extension built with CUDA, hydra/omegaconf wheels in .whl):
#
#     bash benchmarks/imagenet_gpu.sh            # all steps, logs and `time` lines under $OUT (./gpu-out)
#     STEP=cache|compare|sensitivity|sensitivity-wait bash benchmarks/imagenet_gpu.sh
#
# What each step should show:
#   cache        the 50,000 JPEGs decode into the uint8 cache in under 2 minutes on 16 cores (the `real` line
#                of `decode`); a second command on the same data decodes nothing (its log says the cache was used)
#   compare      compare over the 49,000 images not held apart for calibration: the approx row's
#                agreement_fakequant is 1.000 (the exact table equals fake-quant on every image); its time
#   sensitivity  54 layers x 4 tables on data.limit=5000 (eval.repeats=0: accuracy only): the run with the prefix
#                cache takes at most 0.6x the time of sensitivity.prefix_cache=false, and the two sensitivity.csv
#                tables are identical (the `cmp` line prints "rows identical"). The uncached run is about 700-810 s
#                on an H200 (3.0-3.5 s an evaluation, 53 s of set-up; benchmarks/README.md), over one 10-minute device
#                call. On a 2-GPU host, SENS_PAR=1 runs the two side by side, each alone on its GPU and in its own
#                process session, so they outlive the call that starts them (WAIT_S=0 returns at once); then
#                STEP=sensitivity-wait in the next call, on the same machine (sent at once: a machine left idle
#                past the device's idle window goes back, and the runs with it), waits for both and compares. On one
#                GPU: SENS=nocache in two calls, the second with the first's $OUT/r-nocache carried back into $OUT
#                (it resumes from the rows recorded there: add the two `real` lines, take one set-up off), then
#                SENS=cache. SENS_PAR=seq runs the two one after the other (cache first) in one background
#                process session on GPU 0 and half the cores, then STEP=sensitivity-wait as above: each run has
#                its GPU alone, and the other GPU and cores are free for other work. Each progress line is in sens-*.log as it is written, so a call cut short keeps its
#                count and time. PER_CLASS=6 generates the 6,000 images this step needs instead of 50,000.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
# the data cache (7.5 GB for 50,000 images) and the checkpoints apart from $OUT, which a device call brings back
work=${WORK:-/tmp/imagenet-work}
mkdir -p "$work"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc
data=${DATA:-/tmp/imagenet-gen}
run="python3 -m runner.cli"
D="data=imagefolder data.root=$data model=torchvision model.arch=resnet50 model.weights=$data/resnet50_random.pt \
 paths.checkpoints=$work/ckpt"
M="$D backend=cuda"  # train takes no backend
step=${STEP:-all}

# 1000 classes x PER_CLASS JPEGs (50 as ImageNet's val; the sensitivity step needs only 5,000 of them, so a
# device call that times only it may generate 6 a class), of ImageNet's typical sizes, seeded
if [ ! -f "$data/resnet50_random.pt" ] && [ "$step" != sensitivity-wait ]; then  # waiting generates nothing
  python3 - "$data" "${PER_CLASS:-50}" <<'PY'
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

root, per_class = Path(sys.argv[1]), int(sys.argv[2])

def write(c):
    rng = np.random.default_rng(c)
    folder = root / "val" / f"n{c:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(per_class):
        h, w = int(rng.integers(300, 501)), int(rng.integers(333, 501))
        base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)  # smooth-ish, as photos
        img = Image.fromarray(base).resize((w, h), Image.BILINEAR)
        img.save(folder / f"ILSVRC2012_val_{c * per_class + k:08d}.JPEG", quality=90)

with ProcessPoolExecutor() as pool:
    list(pool.map(write, range(1000), chunksize=8))
from runner.models.torchvision_models import build
torch.manual_seed(0)
torch.save(build("resnet50").state_dict(), root / "resnet50_random.pt")
print("generated", sum(1 for _ in root.glob("val/*/*.JPEG")), "JPEGs")
PY
fi

if [ "$step" = all ] || [ "$step" = cache ]; then
  rm -rf "$work/ckpt/data-cache"
  # the decode alone: compare with eval.paths=[pytorch] on one image would still evaluate; `train` with given
  # weights loads the data (the decode) and says there is nothing to train
  { time $run train $D paths.results=$out/r-cache ; } > "$out/decode.log" 2>&1
  tail -4 "$out/decode.log"
  { time $run train $D paths.results=$out/r-cache ; } > "$out/decode2.log" 2>&1
  grep -i "cache\|decod" "$out/decode2.log" | head -3; tail -3 "$out/decode2.log"
fi

if [ "$step" = all ] || [ "$step" = compare ]; then
  # eval.repeats=0: one pass a path (its predictions), no timed pass; the `real` line times the whole command
  { time $run compare $M multiplier=exact eval.batch_size=250 eval.repeats=0 \
      paths.results=$out/r-compare ; } > "$out/compare.log" 2>&1
  tail -12 "$out/compare.log"
fi

if [ "$step" = all ] || [ "$step" = sensitivity ]; then
  T='[mul8s_1L2J,mul8u_17C8,mul8u_T83,mul8s_1L12]'
  E="data.limit=5000 eval.batch_size=250 eval.repeats=0"
  S="$E sensitivity.multipliers=$T sensitivity.plot=false"
  # the cache first (train with given weights only loads the data), so neither timed run pays for decoding
  $run train $D paths.results=$out/r-warm > "$out/sens-warm.log" 2>&1
  half=$(( $(nproc) / 2 ))
  # the command line of a background run (cache|nocache) for `bash -c`, its results and log under $WORK
  cmd() { echo "{ time $run sensitivity $M $S sensitivity.prefix_cache=$([ $1 = cache ] && echo true || echo false) \
    paths.results=$work/r-$1 ; } > $work/sens-$1.log 2>&1"; }
  if [ "${SENS_PAR:-0}" = seq ]; then
    # One after the other (cache first) on GPU 0 and the first half of the cores, in one background process
    # session, as SENS_PAR=1's runs: each run has the GPU to itself, and GPU 1 and the other cores stay free for
    # other work in the same calls. STEP=sensitivity-wait as for SENS_PAR=1.
    CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=$half setsid taskset -c "0-$((half - 1))" bash -c \
        "$(cmd cache); $(cmd nocache)" < /dev/null &
    echo $! > "$work/sens-cache.pid"; cp "$work/sens-cache.pid" "$work/sens-nocache.pid"
  elif [ "${SENS_PAR:-0}" = 1 ]; then
    # Side by side on a 2-GPU host, each run alone on its GPU (cache on 0, no cache on 1), each in its own
    # process session: a device call that ends first leaves them running, and STEP=sensitivity-wait (the next
    # call, on the same machine) waits for them, then compares. Results and logs under $WORK, copied to $OUT.
    # Each on its own half of the cores as well: both calibrate on the CPU with every thread they have, and a
    # first try without this (2x H100, 32 cores) ran each set-up at 100 s instead of 53 and every evaluation
    # slower, the two processes' compute threads spinning on the same cores.
    for c in nocache cache; do
      gpu=$([ $c = cache ] && echo 0 || echo 1)
      cores=$([ $c = cache ] && echo "0-$((half - 1))" || echo "$half-$((2 * half - 1))")
      CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$half setsid taskset -c "$cores" bash -c "$(cmd $c)" < /dev/null &
      echo $! > "$work/sens-$c.pid"
    done
  else
    # SENS=nocache|cache runs one of the two
    for c in ${SENS:-nocache cache}; do
      { time $run sensitivity $M $S sensitivity.prefix_cache=$([ $c = cache ] && echo true || echo false) \
          paths.results=$out/r-$c ; } > "$out/sens-$c.log" 2>&1
      grep -h "evaluations in\|^real" "$out/sens-$c.log"
    done
  fi
fi

if [ "$step" = all ] || [ "$step" = sensitivity ] || [ "$step" = sensitivity-wait ]; then
  res=$out
  if [ -f "$work/sens-cache.pid" ]; then  # SENS_PAR=1: wait as long as this call may, copying what is there
    res=$work
    for c in cache nocache; do
      while kill -0 "$(cat "$work/sens-$c.pid")" 2>/dev/null && [ $SECONDS -lt ${WAIT_S:-100000} ]; do
        cp "$work/sens-$c.log" "$out/" 2>/dev/null; sleep 5
      done
      cp "$work/sens-$c.log" "$out/" 2>/dev/null
      grep -h "evaluations in\|^real" "$out/sens-$c.log"
    done
    # the two tables only: a device call brings back a few files, and each run dir holds many
    for c in cache nocache; do
      cp "$work"/r-$c/sensitivity/*/sensitivity.csv "$out/sensitivity-$c.csv" 2>/dev/null
    done
  fi
  [ -d "$res/r-nocache" ] && [ -d "$res/r-cache" ] || exit 0
  python3 - "$res" <<'PY'
import sys
from pathlib import Path

import pandas as pd

out = Path(sys.argv[1])
try:
    a, b = (pd.read_csv(next((out / d).glob("sensitivity/*/sensitivity.csv"))) for d in ("r-nocache", "r-cache"))
except StopIteration:
    sys.exit("cmp: a sensitivity.csv is missing (a run not finished)")
cols = [c for c in a.columns if c in ("layer", "multiplier", "accuracy", "loss_pts", "status")]
same = a[cols].sort_values(["layer", "multiplier"]).reset_index(drop=True).equals(
    b[cols].sort_values(["layer", "multiplier"]).reset_index(drop=True))
print("cmp:", "rows identical" if same else "ROWS DIFFER", len(a), "rows")
PY
fi
