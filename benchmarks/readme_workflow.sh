#!/bin/bash
# The README's workflow on mnist5k, each command timed by /usr/bin/time (wall, user, sys), into fresh
# results/checkpoint directories, and the dse_spearman table of its sweep; then the same sweep and table on
# Fashion-MNIST. Figures in README.md, docs/exploration.md and benchmarks/README.md come from this script.
#
#   bash benchmarks/readme_workflow.sh OUT_DIR [FASHION_MNIST_ROOT]    # from the repository root
#
# Writes OUT_DIR/{results,fresults,ckpt,home} and the README's three figures under docs/img/.
set -euo pipefail
OUT=${1:?usage: readme_workflow.sh OUT_DIR [FASHION_MNIST_ROOT]}
FM=${2:-}
PY=${PYTHON:-python}
export APPROX_RUN_HOME=$OUT/home
AR="$PY -m runner.cli"
P="paths.results=$OUT/results paths.checkpoints=$OUT/ckpt"
R=$OUT/results/results.csv
t() { echo "=== $*"; /usr/bin/time -f "TIME %e s wall %U user %S sys" "$@"; }
lscpu | grep -i "model name"; nproc; uptime
t $AR sweep sweep.multipliers='mul8*' $P                       # trains the baseline first
t $AR results $R --pivot --markdown
t $AR results $R --plot docs/img/sweep_mnist5k.png
t $AR sensitivity sensitivity.multipliers='mul8*' $P
cp "$(ls -d "$OUT"/results/sensitivity/*/ | tail -1)sensitivity.png" docs/img/sensitivity_mnist5k.png
t $AR search search.multipliers='mul8*' $P
cp "$(ls -d "$OUT"/results/search/*/ | tail -1)pareto.png" docs/img/pareto_mnist5k.png
for m in mul8s_1L2N mul8u_T83 mul8s_1L12; do for g in ste lut; do
  t $AR finetune multiplier=$m finetune.grad=$g $P
done; done
t $AR results $R --pivot --markdown --scope network,finetuned
$PY benchmarks/dse_spearman.py "$(ls -d "$OUT"/results/sweep/*/ | head -1)" --results $R
if [ -n "$FM" ]; then    # accuracy only: one timed pass per path; a 3-epoch baseline (15 is the recipe) to fit a 2-core machine
  t $AR sweep sweep.multipliers='mul8*' data=fashion_mnist data.root="$FM" train.epochs=3 eval.repeats=1 eval.warmup=0 \
    paths.results=$OUT/fresults paths.checkpoints=$OUT/ckpt
  $PY benchmarks/dse_spearman.py "$(ls -d "$OUT"/fresults/sweep/*/ | tail -1)" --results $OUT/fresults/results.csv
fi
