#!/usr/bin/env bash
# One job over 4 GPUs against 1 (docs/distributed.md), four parts, each ending in one summary line
# (bar, measured, PASS/FAIL) in $OUT/summary.txt, printed again at the end:
#
#   resnet18  a retraining epoch of torchvision ResNet-18 (random weights, 10 classes, exact table) on
#             $IMAGES generated 224x224 JPEGs (ImageFolder): epoch 2's finetune epoch time on 1 GPU (batch
#             256) / on 4 GPUs (256 per GPU, global 1024) >= 3.2. Epoch 1 carries the first calls (the LUT
#             kernels' timed picks, cuDNN, allocations): reported, not compared.
#   resnet8   ResNet-8 retrained on Fashion-MNIST (mul8u_T83, the default recipe: 5 epochs, global batch 64)
#             on 4 GPUs ends within 0.5 points of 1 GPU.
#   sweep     the 8-table x 5-epoch Fashion-MNIST retraining sweep (LeNet-5): whole command on 1 GPU / on 4
#             GPUs >= 3 (the sweep's own "jobs in" time, without interpreter start and composition, beside it;
#             then the jobs per GPU and when each process was ready, from the 4-GPU run's schedule.json,
#             whose per-device lines, each job's start and end, are printed before the summary line).
#   eval50    an exact-table evaluation of torchvision ResNet-50 over the $IMAGES generated images: the approx
#             row's timed pass (testset_ms_median) on 1 GPU / sharded on 4 (eval.devices=4) >= 3.3, with the
#             same n_images, correct, accuracy, agreement_fakequant and row_key.
#
# One-time costs stay out of the compared figures and are printed apart: the image generation, the data
# cache build (an untimed `train` with given weights decodes both splits), the baselines (ResNet-8 and
# LeNet-5, 5 epochs each: both runs of a part share one; the ResNets use random weights, which timing and the
# same-row check do not depend on).
#
# On the 4-GPU host, from the repository root (Fashion-MNIST's four .gz files in .fmnist/, wheels in .whl as
# for benchmarks/gpu_session.sh, whose set-up benchmarks/gpu_setup.sh this sources):
#
#     STEP=1 bash benchmarks/ddp_gpu.sh      # build + eval50
#     STEP=2 bash benchmarks/ddp_gpu.sh      # resnet18, resnet8, sweep (no build when runner/_C loads)
#     ONLY=resnet8,sweep bash benchmarks/ddp_gpu.sh   # any parts; STEP=all (the default): all four
#
# Estimated wall time on 4 H100s with 64 cores, from the H200 kernel figures (ResNet-18 LUT forward 2.4-3.2 T
# MAC/s, ResNet-50 2.2-2.6 T MAC/s; 1.8 / 4.1 G MAC per image: an H100 has the same SMs and clocks) and a
# retraining step of ~1.6x the LUT forward (the ste backward is fp32 cuDNN) plus the per-image augmentation on
# the CPU (RandomResizedCrop + flip of 256 images a step, ~0.1-0.15 s, in each rank's process):
#   set-up     wheels ~10 s; build ~130 s, skipped when runner/_C already loads (BUILD=auto, the default)
#   images     50,000 JPEGs at ~2.5 ms each on one core (measured on the CPU here): ~5 s over 64 processes,
#              while the extension builds; the data cache (both splits decoded, 17 GB) ~20-40 s
#   eval50     1 GPU: 205 T MAC a pass / 2.2-2.6 T MAC/s = 80-95 s, twice (the predictions' pass, then the
#              timed one), the fp32 and fake-quant reference passes ~35 s, start and calibration ~20 s:
#              ~215-245 s; 4 GPUs: a quarter of the passes + 4 ranks' start ~30 s: ~85 s       ~300-330 s
#              That estimate was short: on 2 H200s with 20,000 images the 1-GPU command took 176 s, 80 s of it
#              set-up, so 50,000 images take ~80 + 96 x 2.5 = ~320 s on one GPU and ~150-200 s sharded; a
#              STEP=1 call on 4 H200s ran past the 600 s limit. EVAL50_SIDES=1, then EVAL50_SIDES=N on the
#              machine still warm, splits the part over two calls.
#   resnet18   1 GPU: 195 steps x (0.23-0.3 s GPU + ~0.1-0.15 s CPU) = 65-90 s an epoch, 2 epochs + start:
#              ~150-200 s; 4 GPUs: 49 steps an epoch, ~20 s, 2 epochs + 4 ranks' start: ~70 s  ~220-270 s
#   resnet8    baseline 5 epochs ~20 s; 1 GPU 5 x ~2 s + start ~25 s; 4 GPUs (eager DDP, 782 steps of 16
#              per GPU an epoch) 5 x ~8 s + start ~30 s                                      ~120 s
#   sweep      baseline ~15 s; 1 GPU ~55 s (8 jobs of ~6 s + set-up, benchmarks/README.md); 4 GPUs ~25 s  ~100 s
# Groups, each one device call of at most 9 minutes:
#   STEP=1     set-up with the build + images + cache + eval50                     ~470-510 s
#   STEP=2     set-up without the build + images + cache + resnet18 + sweep + resnet8  ~490-540 s: the
#              machine still warm from STEP=1 (its build kept), or STEP=1's $OUT/_C*.so put in runner/ and
#              carried; ~475 s with the images and cache kept too. A STEP=2 that must build (~130 s more)
#              does not fit: run ONLY=resnet18 and then ONLY=resnet8,sweep instead. Each part's line is in
#              $OUT/summary.txt as soon as it ends, so a call cut short keeps the parts it finished.
# A part starts only if its upper estimate fits what is left of BUDGET_S (540 s from the script's start; 0: no
# limit); one that does not prints a SKIP line naming the ONLY= that runs it. The order within a call: eval50,
# resnet18, sweep, resnet8 (the cheapest to run again alone last).
# Environment: OUT (logs, results, summary; default ./gpu-out), WORK (images, checkpoints, data caches, large:
# default /tmp/approx-run-ddp), FMNIST (default ./.fmnist), IMAGES (50000), BUILD (auto; always: rebuild).
# A dry run of every command on the CPU, tiny (no GPU, no build; the commands and the summary's code):
#     DEVICE=cpu IMAGES=200 SIZE=32 B18=8 EVAL_BS=32 FMNIST=/tmp/fmnist-tiny bash benchmarks/ddp_gpu.sh
set -uo pipefail   # no -e: a part that fails prints its FAIL line and the others still run
cd "$(dirname "$0")/.."
out=$(mkdir -p "${OUT:-gpu-out}" && cd "${OUT:-gpu-out}" && pwd)
WORK=${WORK:-/tmp/approx-run-ddp}
FMNIST=$(cd "${FMNIST:-.fmnist}" && pwd) || { echo "FMNIST=${FMNIST:-.fmnist}: no such directory"; exit 2; }
N=${IMAGES:-50000}
SIZE=${SIZE:-224}          # generated images are SIZE x SIZE; the model sees the centre SIZE crop
B18=${B18:-256}            # ResNet-18 retraining batch per GPU
EVAL_BS=${EVAL_BS:-256}
DEVICE=${DEVICE:-cuda}
export NGPU=${NGPU:-4}     # the many-GPU side (the bars are for 4; NGPU=2 on a 2-GPU host: the same runs, their ratios)
BUDGET_S=${BUDGET_S:-$([ "$DEVICE" = cuda ] && echo 540 || echo 0)}   # 0: no limit
STEP=${STEP:-all}
case $STEP in
  1) ONLY=${ONLY:-eval50} ;;
  2) ONLY=${ONLY:-resnet18,resnet8,sweep} ;;
  all) ONLY=${ONLY:-eval50,resnet18,resnet8,sweep} ;;
  *) echo "STEP=$STEP: choose 1, 2 or all"; exit 2 ;;
esac
# EVAL50_SIDES=1 or =N: eval50's 1-GPU or sharded run alone (a call each, on a machine kept warm: the
# verdict needs both results)
EVAL50_SIDES=${EVAL50_SIDES:-1,N}
case $EVAL50_SIDES in 1|N|1,N|N,1) ;; *) echo "EVAL50_SIDES=$EVAL50_SIDES: choose 1, N or 1,N"; exit 2 ;; esac
# a benchmark of the tree runner/_C was built from: no second build when it loads (BUILD=always forces one)
export BUILD=${BUILD:-auto}
CKPT="$WORK/checkpoints"
IMG="$WORK/images${N}_$SIZE"
W18="$IMG/resnet18_10.pt"
W50="$IMG/resnet50_10.pt"
TABLES8='mul8s_1L2J,mul8s_1L2N,mul8s_1L12,mul8s_1KXF,mul8u_17C8,mul8u_T83,mul8u_18UH,mul8u_1A0M'
SUMMARY="$out/summary.txt"
mkdir -p "$WORK" "$CKPT"
: > "$SUMMARY"
want() { [[ ",$ONLY," == *",$1,"* ]]; }
T_START=$SECONDS
export PYTHONUNBUFFERED=1

if [ "$DEVICE" = cuda ]; then
  BACKEND=cuda; ONE='[cuda:0]'; ALL="[$(seq -s, -f 'cuda:%g' 0 $((NGPU - 1)))]"
  ONE_ENV=(env CUDA_VISIBLE_DEVICES=0)  # the 1-GPU runs see one card: nothing of theirs lands on the others
  # NVLink multicast stays off for NCCL and PyTorch, as the device image sets it: on a shared host's GPUs a
  # program using it can take them out of service (set here too, should the environment come without them)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
else
  BACKEND=cpp; ONE='[cpu]'; ALL="[$(printf 'cpu,%.0s' $(seq "$NGPU") | sed 's/,$//')]"; ONE_ENV=(env)
fi
IMGDATA=(data=imagefolder "data.root=$IMG" data.num_classes=10 "data.resize=$((SIZE * 8 / 7))" "data.crop=$SIZE")

# The images (numpy and PIL only: no build needed) while the extension builds.
gen_pid=
if { want resnet18 || want eval50; } && [ ! -f "$IMG/.done" ]; then
  rm -rf "$IMG"
  python3 - "$IMG" "$N" "$SIZE" > "$out/images.log" 2>&1 <<'EOF' &
# N JPEGs in 10 class folders under <root>/train, <root>/val a link to it (the same files for both splits),
# generated over every core; and random 10-class state dicts of ResNet-18 and ResNet-50 (seeded).
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

root, n, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
CLASSES, CHUNK = 10, 500


def make(span):
    for i in range(*span):
        rng = np.random.default_rng(i)
        c = i % CLASSES
        # coarse noise blown up to the image size plus a class-dependent colour cast: learnable, not trivial,
        # and cheap to encode and decode (smooth, ~8 KB a JPEG)
        base = rng.integers(0, 160, (15, 15, 3), dtype=np.uint8) + np.array(
            [c * 9, 90 - c * 9, (c * 37) % 90], dtype=np.uint8)
        Image.fromarray(base).resize((size, size), Image.BILINEAR).save(
            root / "train" / f"class{c}" / f"{i:06d}.jpg", quality=85)
    return span[1] - span[0]


if __name__ == "__main__":
    t0 = time.perf_counter()
    for c in range(CLASSES):
        (root / "train" / f"class{c}").mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        done = sum(pool.map(make, [(i, min(n, i + CHUNK)) for i in range(0, n, CHUNK)]))
    (root / "val").symlink_to("train")
    spent = time.perf_counter() - t0
    import torch
    import torchvision

    for arch in ("resnet18", "resnet50"):
        torch.manual_seed(0)
        torch.save(torchvision.models.get_model(arch, num_classes=CLASSES).state_dict(), root / f"{arch}_10.pt")
    (root / ".done").write_text("")
    print(f"images: {done} {size}x{size} JPEGs in {spent:.1f} s on {os.cpu_count()} processes")
EOF
  gen_pid=$!
fi

if [ "$DEVICE" = cuda ]; then
  source benchmarks/gpu_setup.sh || exit 1
  # the extension comes back with $OUT: carried as runner/ of a later call on a fresh machine, it spares the build
  [ -f "$out/build.log" ] && cp -p runner/_C*.so "$out/" 2>/dev/null
  python3 -c "import sys, torch; n = torch.cuda.device_count(); print(f'GPUs: {n}'); sys.exit(n < $NGPU)" \
    || { echo "NGPU=$NGPU: this host has fewer GPUs"; exit 2; }
fi
echo "CPU cores: $(nproc); parts: $ONLY; out: $out; work: $WORK"
if [ -n "$gen_pid" ]; then
  wait "$gen_pid" || { cat "$out/images.log"; echo "image generation failed"; exit 1; }
  tail -1 "$out/images.log"
fi

# A command, its wall seconds in $out/<label>.wall; results under $out/<label>, log $out/<label>.log.
timed() {
  local label=$1; shift
  rm -rf "${out:?}/$label"
  local t0=$EPOCHREALTIME rc=0
  "$@" "paths.results=$out/$label" "paths.checkpoints=$CKPT" >"$out/$label.log" 2>&1 || rc=$?
  python3 -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.2f}')" "$EPOCHREALTIME" "$t0" \
    > "$out/$label.wall"
  printf '   %-14s %8s s wall%s\n' "$label" "$(cat "$out/$label.wall")" "$([ $rc = 0 ] || echo "  (exit $rc: $out/$label.log)")"
  return $rc
}
cli() { python3 -m runner.cli "$@"; }

# Whether a part estimated at $2 s (the header's upper figure) fits what is left of BUDGET_S since the start;
# else its SKIP line: the call ends within its limit and says which part to run in another.
fits() {
  [ "$BUDGET_S" = 0 ] && return 0
  (( SECONDS - T_START + $2 <= BUDGET_S )) && return 0
  echo "SKIP  $1  ~$2 s estimated, $((BUDGET_S - SECONDS + T_START)) s left of BUDGET_S=$BUDGET_S: run ONLY=$1" \
    | tee -a "$SUMMARY"
  return 1
}
one() { "${ONE_ENV[@]}" python3 -m runner.cli "$@"; }

# The summary line of a part, from its runs' results (appended to $SUMMARY and printed).
verdict() {
  python3 - "$1" "$out" >> "$SUMMARY" <<'EOF'
import os
import sys
from pathlib import Path

import pandas as pd

part, out = sys.argv[1], Path(sys.argv[2])
NG = int(os.environ["NGPU"])  # the labels' many-GPU side; the bars' text says 4 GPUs


def rows(label, path):
    df = pd.read_csv(out / label / "results.csv")
    return df[(df["path"] == path) & (df["status"] == "ok")]


def wall(label):
    return float((out / f"{label}.wall").read_text())


def line(ok, bar, measured):
    return f"{'PASS' if ok else 'FAIL'}  {part:<9} bar: {bar:<48} measured: {measured}"


try:
    if part == "resnet18":
        logs = {k: pd.read_csv(next((out / f"r18_{k}" / "finetune").glob("*/finetune_log.csv")))
                for k in ("1gpu", f"{NG}gpu")}
        e1, e4 = (logs[k].set_index("epoch")["epoch_s"] for k in ("1gpu", f"{NG}gpu"))
        r = e1[2] / e4[2]
        print(line(r >= 3.2, "epoch 2, 1 GPU / 4 GPUs >= 3.20x",
                   f"{r:.2f}x ({e1[2]:.1f} s / {e4[2]:.1f} s; epoch 1 with first calls {e1[1]:.1f} s / "
                   f"{e4[1]:.1f} s)"))
    elif part == "resnet8":
        a1, a4 = (float(rows(f"r8_{k}", "approx_finetuned")["accuracy"].iloc[-1]) for k in ("1gpu", f"{NG}gpu"))
        d = abs(a1 - a4) * 100
        print(line(d <= 0.5, "|4 GPUs - 1 GPU| <= 0.50 points",
                   f"{d:.2f} points ({100 * a1:.2f} % on 1 GPU, {100 * a4:.2f} % on {NG})"))
    elif part == "sweep":
        import re

        def jobs_s(label):
            found = re.findall(r"jobs in ([0-9.]+)s", (out / f"{label}.log").read_text())
            return float(found[-1]) if found else float("nan")

        def spread(label):  # jobs per device and when the processes were ready (the sweep's schedule.json)
            import json

            try:
                sched = json.loads(next((out / label / "sweep").glob("*/schedule.json")).read_text())
            except (StopIteration, OSError, ValueError):
                return "no schedule"
            ps = sched["processes"]
            ready = [p["ready_s"] for p in ps if p.get("ready_s") is not None]
            return (f"jobs per GPU {','.join(str(len(p['jobs'])) for p in ps)}"
                    + (f", ready at {min(ready):.1f}-{max(ready):.1f} s" if ready else ""))

        ok = [len(rows(f"sweep8_{k}", "approx_finetuned")) for k in ("1gpu", f"{NG}gpu")]
        w1, w4 = wall("sweep8_1gpu"), wall(f"sweep8_{NG}gpu")
        r = w1 / w4
        print(line(r >= 3.0 and ok == [8, 8], "whole command, 1 GPU / 4 GPUs >= 3.00x",
                   f"{r:.2f}x ({w1:.1f} s / {w4:.1f} s; the sweeps' own: {jobs_s('sweep8_1gpu'):.1f} s / "
                   f"{jobs_s(f'sweep8_{NG}gpu'):.1f} s; finetuned rows {ok[0]} and {ok[1]} of 8; "
                   f"{spread(f'sweep8_{NG}gpu')})"))
    elif part == "eval50":
        a1, a4 = (rows(f"r50_{k}", "approx").iloc[-1] for k in ("1gpu", f"{NG}gpu"))
        cols = ["n_images", "correct", "accuracy", "agreement_fakequant", "row_key"]
        same = all(a1[c] == a4[c] for c in cols)
        r = a1["testset_ms_median"] / a4["testset_ms_median"]
        print(line(r >= 3.3 and same, "timed pass, 1 GPU / 4 GPUs >= 3.30x, same row",
                   f"{r:.2f}x ({a1['testset_ms_median'] / 1e3:.1f} s / {a4['testset_ms_median'] / 1e3:.1f} s a "
                   f"pass; whole commands {wall('r50_1gpu'):.0f} s / {wall(f'r50_{NG}gpu'):.0f} s); row "
                   f"{'the same' if same else 'DIFFERS: ' + str({c: (a1[c], a4[c]) for c in cols if a1[c] != a4[c]})}"
                   f" ({int(a1['correct'])} of {int(a1['n_images'])} correct, eval_world_size "
                   f"{a4.get('eval_world_size')})"))
except Exception as exc:  # noqa: BLE001  (a run that failed leaves no results: the part fails, with why)
    print(line(False, part, f"no result ({type(exc).__name__}: {exc}); see the part's logs in {out}"))
EOF
  tail -1 "$SUMMARY"
}

if want resnet18 || want eval50; then
  echo "== data cache: decode both splits of $IMG (one-time, untimed in the parts)"
  timed prep_cache cli train model=torchvision model.arch=resnet18 "model.weights=$W18" +model.num_classes=10 \
    "${IMGDATA[@]}"
fi

side() { [[ ",$EVAL50_SIDES," == *",$1,"* ]]; }
if want eval50 && fits eval50 $( (side 1 && side N && echo 560) || (side 1 && echo 360) || echo 220); then
  echo "== eval50: torchvision ResNet-50, exact table, $N images, batch $EVAL_BS, 1 GPU then sharded over $NGPU"
  r50=(compare model=torchvision model.arch=resnet50 "model.weights=$W50" +model.num_classes=10 "${IMGDATA[@]}"
       "backend=$BACKEND" multiplier=exact "eval.batch_size=$EVAL_BS" eval.warmup=1 eval.repeats=1 'eval.paths=[approx]')
  side 1 && timed r50_1gpu one "${r50[@]}"
  side N && timed "r50_${NGPU}gpu" cli "${r50[@]}" "eval.devices=$NGPU"
  [ -d "$out/r50_1gpu" ] && [ -d "$out/r50_${NGPU}gpu" ] && verdict eval50
fi

if want resnet18 && fits resnet18 270; then
  echo "== resnet18: torchvision ResNet-18 retrained 2 epochs on $N images, $B18 per GPU, exact table"
  r18=(finetune model=torchvision model.arch=resnet18 "model.weights=$W18" +model.num_classes=10 "${IMGDATA[@]}"
       "backend=$BACKEND" multiplier=exact finetune.epochs=2 finetune.force=true eval.limit=1000 eval.repeats=0)
  timed r18_1gpu one "${r18[@]}" "finetune.batch_size=$B18"
  timed "r18_${NGPU}gpu" cli "${r18[@]}" "finetune.batch_size=$((NGPU * B18))" "finetune.devices=$NGPU"
  verdict resnet18
fi

if want sweep && fits sweep 110; then
  echo "== sweep: 8 tables x 5 epochs on Fashion-MNIST (LeNet-5), one GPU per job, 1 GPU then $NGPU"
  fm=(data=fashion_mnist "data.root=$FMNIST" train.epochs=5)
  timed prep_lenet5 one train "${fm[@]}"
  sw=(sweep "sweep.multipliers=$TABLES8" "${fm[@]}" "backend=$BACKEND" finetune.epochs=5 finetune.force=true)
  timed sweep8_1gpu one "${sw[@]}" "sweep.devices=$ONE"
  timed "sweep8_${NGPU}gpu" cli "${sw[@]}" "sweep.devices=$ALL"
  # the many-device run's schedule: each device's jobs, start and end, and when its process was ready
  awk '/^sweep schedule/ {on = 1; print; next} on && /^  [a-z]/ && / jobs|sharded/ {print; next} {on = 0}' \
    "$out/sweep8_${NGPU}gpu.log"
  verdict sweep
fi

if want resnet8 && fits resnet8 130; then
  echo "== resnet8: ResNet-8 on Fashion-MNIST, mul8u_T83, the default recipe, 1 GPU then $NGPU"
  fm8=(model=resnet8 data=fashion_mnist "data.root=$FMNIST" train.epochs=5)
  timed prep_resnet8 one train "${fm8[@]}"
  r8=(finetune "${fm8[@]}" "backend=$BACKEND" multiplier=mul8u_T83 finetune.force=true eval.repeats=0)
  timed r8_1gpu one "${r8[@]}"
  timed "r8_${NGPU}gpu" cli "${r8[@]}" "finetune.devices=$NGPU"
  verdict resnet8
fi

made=$(sed -n 's/^images: //p' "$out/images.log" 2>/dev/null | tail -1)
once="images: ${made:-none made in this call}"
for l in prep_cache prep_resnet8 prep_lenet5; do
  [ -f "$out/$l.wall" ] && once="$once; $l $(cat "$out/$l.wall") s"
done
echo "== summary: $((SECONDS - T_START)) s in all; one-time costs, not in the figures: ${once}"
cat "$SUMMARY"
