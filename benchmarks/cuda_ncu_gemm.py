"""One expanded_gemm variant on ResNet-50's 1x1 256 -> 64 conv at 56x56 and ViT-B/16's fc1 (batch 64), for `ncu`
(not a benchmark: no timing here). The first round of calls builds the tables; profile the second, e.g.

    ncu -k regex:gemm_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/cuda_ncu_gemm.py expanded_gemm_r8c
    ncu -k regex:gemm_kernel --launch-skip 2 --launch-count 2 --section SourceCounters --section WarpStateStats \\
        --page source --print-source sass --csv python3 benchmarks/cuda_ncu_gemm.py expanded_gemm_r8c > src.csv

(the tall tile's kernel is `tall_kernel`). benchmarks/imagenet.md has what these showed."""
import sys

import torch

import runner._C  # noqa: F401

algo = sys.argv[1] if len(sys.argv) > 1 else "expanded_gemm_r8c"
g = torch.Generator(device="cuda").manual_seed(0)
lut = torch.randint(-16000, 16000, (256, 256), generator=g, dtype=torch.int32, device="cuda")
a = torch.randint(0, 256, (64, 256, 56, 56), generator=g, dtype=torch.uint8, device="cuda")
w = torch.randint(-127, 128, (64, 256, 1, 1), generator=g, dtype=torch.int8, device="cuda")
a2 = torch.randint(0, 256, (64 * 197, 768), generator=g, dtype=torch.uint8, device="cuda")
w2 = torch.randint(-127, 128, (3072, 768), generator=g, dtype=torch.int8, device="cuda")
for _ in range(2):
    torch.ops.approx.lut_conv2d(a, w, lut, [1, 1], [0, 0], [1, 1], 1, algo)
    torch.ops.approx.lut_linear(a2, w2, lut, algo)
torch.cuda.synchronize()
