"""A short run of every CUDA variant, for compute-sanitizer (each result checked against the python
reference):

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/cuda_memcheck.py

Shapes: the LeNet-5 layers at batch 3, a grouped strided conv, padded 3x3 and 7x7 convs, odd linear
widths; int16 and int32 LUTs (both table formats), signed and unsigned codes. Every variant that
approx::lut_algos says applies runs, with the prepared-table cache on (the default) and, for
`auto`, its timed trial. Then lut_bmm (its timed pick) and every approx::lut_bmm variant on batched
matmuls whose M, N and K end mid-tile, with K a multiple of 4 (codes staged as words) and not;
`--bmm-only` runs these alone.
"""
import sys

import torch

from runner.bench import LENET5_LAYERS
from runner.ops import algo_table, lut_bmm, lut_bmm_variant, lut_bmm_variants, lut_conv2d, lut_linear
from runner.reference import reference_lut_bmm, reference_lut_conv2d, reference_lut_linear

CONVS = [((3, *a), w, 1, 0, 1) for _, kind, a, w in LENET5_LAYERS if kind == "conv"] + [
    ((2, 8, 11, 9), (12, 4, 3, 3), 2, 1, 2),
    ((2, 3, 9, 11), (20, 3, 3, 3), 1, 1, 1),
    ((3, 12, 9, 7), (37, 12, 1, 1), 2, 1, 1),   # 1x1, stride 2, padding (expanded_gemm, expanded_window)
    ((7, 12, 14, 14), (20, 12, 1, 1), 1, 0, 1),  # 1x1, stride 1: r8c copies its codes (1372 rows, tiles across images)
    # KxK (expanded_gemm's implicit im2col): a 7x7 stride 2 stem (K = 147, 1104 rows: two tiles of
    # r8), a strided 3x3 with N past one channel tile
    ((2, 3, 45, 47), (40, 3, 7, 7), 2, 3, 1),
    ((3, 40, 13, 12), (70, 40, 3, 3), 2, 1, 1),
    ((2, 6, 13, 11), (6, 1, 3, 3), 1, 1, 6),    # depthwise 3x3 (depthwise, depthwise_rows)
    ((37, 4, 14, 14), (4, 1, 3, 3), 2, 1, 4),   # depthwise stride 2: tiles spanning many images
    ((2, 3, 9, 10), (3, 1, 3, 3), 2, 0, 3),     # depthwise stride 2, no padding
    # depthwise on rows a multiple of 4 wide (window words loaded from global memory, rows and columns outside as pad)
    ((3, 4, 12, 16), (4, 1, 3, 3), 1, 1, 4),
    ((2, 3, 11, 20), (3, 1, 3, 3), 2, 0, 3),
    ((1, 2, 5, 1200), (2, 1, 3, 3), 1, 1, 2),  # rows wider than a tile's tasks
    # rows a multiple of 8 wide, 8 outputs a thread: words in 8-byte pairs, windows from a pair's second word (padding
    # 1) or first (none); the last pair past the row
    ((2, 3, 9, 32), (3, 1, 3, 3), 1, 1, 3),
    ((3, 2, 9, 24), (2, 1, 3, 3), 2, 0, 2),
    # depthwise on inputs a multiple of 4 bytes whose rows are not (words at byte offsets, edge columns masked)
    ((5, 3, 14, 14), (3, 1, 3, 3), 1, 1, 3),
    ((37, 8, 7, 7), (8, 1, 3, 3), 2, 1, 8),    # planes 1-3 bytes into a word, the last word the input's
    # depthwise_planes: 7x7 planes 1-3 bytes into a word (the input's last word read), a block's second warp partial
    ((37, 9, 7, 7), (9, 1, 3, 3), 1, 1, 9),
]
BMMS = [(3, 37, 41, 64), (2, 197, 197, 68), (2, 197, 64, 197), (1, 5, 300, 7)]  # (B, M, N, K)
LINEARS = [(3, *w[::-1]) for _, kind, _, w in LENET5_LAYERS if kind == "linear"] + [
    (37, 100, 17), (5, 33, 3), (700, 84, 10), (1100, 130, 45), (1030, 2, 97), (600, 11, 31), (2100, 37, 20)]


def configs(algos):
    """The applicable algos plus the configurations auto may pick that the algo table does not list:
    depthwise_rows' fixed grids (1 block a channel, and 3: tiles shared unevenly) and expanded_gemm's (each
    its own kernel; r8w and r8c their own table builds)."""
    algos = algos + [f"{a}_g{g}" for a in algos if a.startswith("depthwise_rows") for g in (1, 3)]
    if "expanded_gemm" not in algos:
        return algos
    return algos + ["expanded_gemm_r2", "expanded_gemm_r4", "expanded_gemm_r8", "expanded_gemm_r8w",
                    "expanded_gemm_r8c", "expanded_gemm_r8c_k3", "expanded_gemm_r16c", "expanded_gemm_r16c_k3",
                    "expanded_gemm_r13c", "expanded_gemm_r13c_k3"]


def main(bmm_only=False):
    gen = torch.Generator().manual_seed(0)
    ran = set()
    for signed in (True, False):
        for lutkind in ("int16", "int32"):
            hi = 2**15 - 1 if lutkind == "int16" else 2**31 - 1
            lut = torch.randint(-hi, hi, (256, 256), generator=gen, dtype=torch.int64).to(torch.int32)
            lo = (-128, 128) if signed else (0, 256)
            dt = torch.int8 if signed else torch.uint8
            for m, k, n in [] if bmm_only else LINEARS:
                a = torch.randint(*lo, (m, k), generator=gen, dtype=torch.int64).to(dt)
                w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
                want = reference_lut_linear(a, w, lut)
                ad, wd, ld = a.cuda(), w.cuda(), lut.cuda()
                for algo in configs(["auto"] + [r["algo"] for r in algo_table(ad, wd, ld, backend="cuda")
                                                      if r["applies"]]):
                    got = lut_linear(ad, wd, ld, backend="cuda", algo=algo).cpu()
                    assert torch.equal(got, want), (m, k, n, algo)
                    ran.add(algo)
            for ashape, wshape, stride, pad, groups in [] if bmm_only else CONVS:
                a = torch.randint(*lo, ashape, generator=gen, dtype=torch.int64).to(dt)
                w = torch.randint(-127, 128, wshape, generator=gen, dtype=torch.int8)
                want = reference_lut_conv2d(a, w, lut, stride, pad, 1, groups)
                ad, wd, ld = a.cuda(), w.cuda(), lut.cuda()
                args = (stride, pad, 1, groups)
                for algo in configs(["auto"] + [r["algo"] for r in algo_table(ad, wd, ld, *args, backend="cuda")
                                                      if r["applies"]]):
                    got = lut_conv2d(ad, wd, ld, *args, backend="cuda", algo=algo).cpu()
                    assert torch.equal(got, want), (ashape, wshape, algo)
                    ran.add(algo)
            for bsz, m, n, k in BMMS:
                a = torch.randint(*lo, (bsz, m, k), generator=gen, dtype=torch.int64).to(dt)
                b = torch.randint(-128, 128, (bsz, n, k), generator=gen, dtype=torch.int64).to(torch.int8)
                want = reference_lut_bmm(a, b, lut)
                ad, bd, ld = a.cuda(), b.cuda(), lut.cuda()
                assert torch.equal(lut_bmm(ad, bd, ld, backend="cuda").cpu(), want), (m, n, k, "lut_bmm")
                for v in lut_bmm_variants():
                    assert torch.equal(lut_bmm_variant(ad, bd, ld, v, backend="cuda").cpu(), want), (m, n, k, v)
                    ran.add(f"lut_bmm {v}")
    torch.cuda.synchronize()
    print("memcheck run: every result equals the reference; variants run:", ", ".join(sorted(ran)))


if __name__ == "__main__":
    main(bmm_only="--bmm-only" in sys.argv[1:])
