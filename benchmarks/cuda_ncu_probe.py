# One call per LeNet layer variant, for `ncu` (not a benchmark: no timing here). Tables are built
# by a first round of calls; profile the kernels of the second, e.g.
#   ncu -k regex:"window|rows" --launch-skip 3 --launch-count 3 --section SpeedOfLight \
#       --section WarpStateStats --section MemoryWorkloadAnalysis python3 benchmarks/cuda_ncu_probe.py
import torch
import runner._C  # noqa: F401
from runner.multipliers.core import exact_lut

g = torch.Generator(device="cuda").manual_seed(0)
lut = exact_lut(signed=False).to("cuda")
def u(shape): return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device="cuda")
def w(shape): return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8, device="cuda")
c2, f1, f2 = u((10000, 6, 12, 12)), u((10000, 256)), u((10000, 120))
w2, wf1, wf2 = w((16, 6, 5, 5)), w((120, 256)), w((84, 120))
for _ in range(2):
    torch.ops.approx.lut_conv2d(c2, w2, lut, [1, 1], [0, 0], [1, 1], 1, "expanded_window")
    torch.ops.approx.lut_linear(f1, wf1, lut, "expanded_rows_r4_c2")
    torch.ops.approx.lut_linear(f2, wf2, lut, "expanded_rows_r2_c1")
torch.cuda.synchronize()
