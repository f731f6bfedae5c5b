"""Whole-LeNet-5 forward time, requant=float vs integer, approx (backend=cpp) and fake-quant, 4,000 mnist5k
test images in one batch, untrained weights (speed does not depend on them), one thread, warm-up 1, median of 5.

    OMP_NUM_THREADS=1 python benchmarks/requant_speed.py
"""
import time, torch
from runner.models import LeNet5
from runner.layers import quantized_models
from runner.multipliers import resolve
from runner.quant import QuantConfig
from runner.data import load_mnist5k
torch.set_num_threads(1)
d = load_mnist5k(seed=0)
m = LeNet5()
x = d.test_x.repeat(4, 1, 1, 1)  # 4000 images
def t(f, n=5):
    f(); ts=[]
    for _ in range(n):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    return sorted(ts)[n//2]*1000
with torch.no_grad():
    print("pytorch fp32 %.0f ms" % t(lambda: m(x)))
    for rq in ("float", "integer", "float", "integer"):
        fq, ap, _ = quantized_models(m, resolve({"name": "mul8s_1L2J"}), QuantConfig(requant=rq), d.train_x, backend="cpp")
        print(rq, "approx cpp %.0f ms" % t(lambda: ap(x)), "fakequant %.0f ms" % t(lambda: fq(x)))
