#!/usr/bin/env bash
# Sweeps over every GPU of a host (runner/workers.py), the joblib launcher's end, and Fashion-MNIST
# retraining on 1 vs 2 GPUs: wall seconds of whole commands (process start to return), median of
# REPEATS runs, each into a fresh results directory (nothing skipped). Baselines are trained first, untimed.
#
#   bash benchmarks/multi_gpu.sh /path/to/fashion-mnist [out dir]      # on a 2-GPU host, from the repo root
#   REPEATS=1 FINETUNE=0 bash benchmarks/multi_gpu.sh /data/fmnist      # quicker: no retraining rows
#   SWEEP19=0 FT_EPOCHS=3 bash benchmarks/multi_gpu.sh /data/fmnist     # only the retraining sweep, 3 epochs a table
#   FT_TABLES='mul8s_1L2J,mul8s_1L2N' ... # other tables for the retraining sweep; after each two-GPU run it
#   prints how many jobs each card ran (the pool's claim rule) and each job's seconds
#
# Bars (docs/sweeps.md): the 19-table mnist5k sweep on 2 GPUs within 1.3x of 1 GPU in-process (and
# <= 5 s on one H100); joblib returns right after its last job; the 4-table finetune.epochs=1 Fashion-MNIST
# sweep >= 1.7x faster on 2 GPUs than on 1.
set -euo pipefail
FMNIST=${1:?usage: bash benchmarks/multi_gpu.sh FASHION_MNIST_DIR [OUT_DIR]}
OUT=${2:-/tmp/approx-run-multi-gpu}
REPEATS=${REPEATS:-3}
PY=${PYTHON:-python3}
# the 19 EvoApproxLib tables the multi-GPU bar was set with (all 13 signed, 6 unsigned)
TABLES19='mul8s_*,mul8u_17C8,mul8u_197B,mul8u_1JJQ,mul8u_2V0,mul8u_NLX,mul8u_T83'
# the retraining sweep's tables (FT_TABLES: others, e.g. 8 of them, to see the pool share longer sweeps)
TABLES4=${FT_TABLES:-'mul8s_1L2J,mul8s_1L2N,mul8u_17C8,mul8u_T83'}
CKPT="$OUT/checkpoints"
mkdir -p "$OUT"

"$PY" - <<'EOF'
import os, platform, torch
print(f"host: {platform.node()}  GPUs: {torch.cuda.device_count()} "
      f"({', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))})  "
      f"CPU cores: {os.cpu_count()}  torch {torch.__version__}")
EOF

# One timed command, REPEATS times; prints the median wall seconds and each run's.
timed() {
  local label=$1; shift
  local walls=()
  for r in $(seq 1 "$REPEATS"); do
    rm -rf "$OUT/$label.$r"
    local t0=$EPOCHREALTIME
    "$PY" -m runner.cli "$@" "paths.results=$OUT/$label.$r" "paths.checkpoints=$CKPT" >"$OUT/$label.$r.log" 2>&1 \
      || echo "  $label run $r: exit $? (log $OUT/$label.$r.log)"
    walls+=("$("$PY" -c "print(f'{$EPOCHREALTIME - $t0:.2f}')")")
  done
  "$PY" -c "import statistics, sys; w = [float(x) for x in sys.argv[2:]]; \
print(f'{sys.argv[1]:<44} median {statistics.median(w):7.2f} s   runs {w}')" "$label" "${walls[@]}"
}

echo "== baselines (untimed)"
"$PY" -m runner.cli train "paths.checkpoints=$CKPT" "paths.results=$OUT/train" >"$OUT/train_mnist5k.log" 2>&1
"$PY" -m runner.cli train data=fashion_mnist "data.root=$FMNIST" "paths.checkpoints=$CKPT" \
  "paths.results=$OUT/train" >"$OUT/train_fmnist.log" 2>&1

if [ "${SWEEP19:-1}" = 1 ]; then
echo "== mnist5k, 19 tables, backend=cuda"
timed sweep19_1gpu_in_process sweep "sweep.multipliers=$TABLES19" backend=cuda 'sweep.devices=[cuda:0]'
timed sweep19_2gpu_auto sweep "sweep.multipliers=$TABLES19" backend=cuda sweep.devices=auto
timed sweep19_joblib sweep "sweep.multipliers=$TABLES19" backend=cuda hydra/launcher=joblib
timed sweep19_2gpu_auto_again sweep "sweep.multipliers=$TABLES19" backend=cuda sweep.devices=auto  # host drift
fi

if [ "${FINETUNE:-1}" = 1 ]; then
  ep=${FT_EPOCHS:-1}
  nt=$(tr ',' '\n' <<<"$TABLES4" | wc -l)
  echo "== Fashion-MNIST, $nt tables, finetune.epochs=$ep, backend=cuda"
  fm=(data=fashion_mnist "data.root=$FMNIST" finetune.epochs=$ep finetune.force=true)  # force: every run retrains (finetuned checkpoints are cached)
  timed fmnist${nt}_ft${ep}_1gpu sweep "sweep.multipliers=$TABLES4" backend=cuda "${fm[@]}" 'sweep.devices=[cuda:0]'
  timed fmnist${nt}_ft${ep}_2gpu sweep "sweep.multipliers=$TABLES4" backend=cuda "${fm[@]}" sweep.devices=auto
  # which process ran each job (the worker's rows name cuda:1) and each job's seconds (its job.json): a
  # pre-warmed worker's first job should cost about what cuda:0's jobs after its first cost
  for r in $(seq 1 "$REPEATS"); do
    "$PY" - "$OUT/fmnist${nt}_ft${ep}_2gpu.$r" <<'EOF'
import json, sys
from pathlib import Path
import pandas as pd
root = Path(sys.argv[1])
rows = pd.read_csv(root / "results.csv")
rows = rows[rows["path"] == "approx"]
jobs = sorted(root.glob("sweep/*/[0-9]*/job.json"), key=lambda p: int(p.parent.name))
device = {Path(d).parts[-2:]: dev for d, dev in zip(rows["run_dir"], rows["device"])}
print(f"  {root.name}: jobs per device {rows['device'].value_counts().sort_index().to_dict()}, job seconds "
      f"{[(device.get(p.parent.parts[-2:], '?'), json.loads(p.read_text()).get('elapsed_s')) for p in jobs]}")
EOF
  done
fi
echo "logs and results: $OUT"
