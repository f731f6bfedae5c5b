#!/usr/bin/env bash
# The ViT's GPU bars (model=vit, docs/models.md "Transformers"). On the GPU machine, from the repository root, with
# the extension built with its CUDA kernels (approx::lut_bmm included) and FMNIST the folder of the Fashion-MNIST
# IDX files:
#
#     FMNIST=DIR bash benchmarks/vit_gpu.sh
#
# What it should show:
#   1. train: the fp32 ViT's Fashion-MNIST test accuracy >= 0.89 (the saved checkpoint's line).
#   2. cuda == cpp: "cuda == cpp: True" for the model with every Linear and the attention products (qk, av) on
#      mul8s_1L2N, and with the products on mul8u_2V0 and the rest on the exact signed table (logits over 2,000
#      test images, compared bit for bit). The products alone on mul8u_2V0 would leave the Linears and the patch
#      conv in fp32, whose float32 sums each device orders its own way: those logits cannot agree bit for bit.
#      Where they part, if they do: python benchmarks/vit_bits.py --checkpoint $OUT/ckpt/<the vit checkpoint>
#      --fmnist $FMNIST (the first module and layer that differ, with and without the float64 steps).
#   3. compare, exact table with the products: agreement_fakequant 1.000 on the approx row (cuda).
#   4. finetune multiplier=mul8s_1L2N model.approx_matmuls=true: the approx_finetuned row's accuracy within 1.5
#      points of the fakequant row's (the script prints both and the gap).
# Logs and results go to $OUT (default ./vit-gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-vit-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
: "${FMNIST:?set FMNIST to the folder of the Fashion-MNIST IDX files}"
PY=${PY:-python3}
AR=${AR:-approx-run}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
common=(model=vit data=fashion_mnist "data.root=$FMNIST" device=cuda "paths.checkpoints=$out/ckpt")

echo "== 1. fp32 training"
/usr/bin/time -f "train %e s" $AR train "${common[@]}" "paths.results=$out/train" 2>&1 | tail -4

echo "== 2. cuda == cpp with the attention products"
$PY - "$FMNIST" "$out/ckpt" <<'PYEOF'
import sys
import torch
from runner.config import compose
from runner.layers import convert_model, quantized_models
from runner.models import fold_input_normalization
from runner.multipliers import resolve
from runner.quant import QuantConfig, quant_layers
from runner.session import Session

cfg = compose("compare", ["model=vit", "data=fashion_mnist", f"data.root={sys.argv[1]}", "model.approx_matmuls=true",
                          f"paths.checkpoints={sys.argv[2]}"])
model, _, _, data = Session().baseline(cfg)
x = data.test_x[:2000]
# an unsigned table on the products (sign-magnitude), the exact signed one on the layers with signed inputs
mixed = {n: resolve("mul8u_2V0" if n.endswith((".qk", ".av")) else "exact") for n in quant_layers(model)}
for name, m in (("mul8s_1L2N", resolve("mul8s_1L2N")), ("mul8u_2V0 products, exact rest", mixed)):
    _, cpp, stats = quantized_models(model, m, QuantConfig(), data.train_x, backend="cpp")
    folded = fold_input_normalization(model, x[:1])
    cuda = convert_model(folded, m, QuantConfig(), stats, backend="cuda").cuda()
    with torch.no_grad():
        a = torch.cat([cpp(x[i:i + 500]) for i in range(0, len(x), 500)])
        b = torch.cat([cuda(x[i:i + 500].cuda()).cpu() for i in range(0, len(x), 500)])
    print(f"{name}: cuda == cpp: {torch.equal(a, b)} (max |diff| {(a - b).abs().max().item():.3g})")
PYEOF

echo "== 3. compare, exact table, products in the table"
$AR compare "${common[@]}" multiplier=exact model.approx_matmuls=true backend=cuda "paths.results=$out/compare" 2>&1 | tail -8

echo "== 4. finetune through the products"
$AR finetune "${common[@]}" multiplier=mul8s_1L2N model.approx_matmuls=true backend=cuda "paths.results=$out/ft" 2>&1 | tail -10
$PY - "$out/ft/results.csv" <<'PYEOF'
import sys, pandas as pd
rows = pd.read_csv(sys.argv[1]).set_index("path")["accuracy"]
gap = 100 * (rows["fakequant"] - rows["approx_finetuned"])
print(f"fakequant {rows['fakequant']:.4f}  approx {rows['approx']:.4f}  approx_finetuned {rows['approx_finetuned']:.4f}"
      f"  gap {gap:.2f} points (bar: <= 1.5)")
PYEOF
