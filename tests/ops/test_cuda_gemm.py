"""CUDA expanded_gemm (gemm.cu, gemm_tall.cu): every configuration it has (expanded_gemm_r2/r4/r8/r8w/r8c,
r16c and r13c (the tall tile at 2048 and 1664 rows), r8c, r16c and r13c with K split over 2, 3 and 64 blocks, the one
auto would run) bit-exact against the python reference on linear layers, 1x1 convs and KxK convs
(implicit im2col: the padding tested per tap), int16 and int32 products, signed and unsigned codes,
outputs poisoned first; and the shapes and names it declines.

Marked `cuda` (deselected by default; run with `-m cuda` on a GPU machine)."""
import math

import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.ops.test_cuda import (  # noqa: E402  (skips itself without CUDA kernels)
    DEV, _pair, check_equal, make_codes, make_lut, make_weights, poisoned_call)

from runner.ops import algo_table  # noqa: E402
from runner.reference import reference_lut_conv2d, reference_lut_linear  # noqa: E402
from tests.ops.conftest import taps_of  # noqa: E402

ops = torch.ops.approx

GEMM_CASES = [
    # linear (M, K, N) or conv ((B, C, H, W), (N, kh, kw), stride, padding, dilation), one group
    (1100, 37, 70),                 # two row tiles of 1024, K % 4 != 0
    (700, 1001, 9),                 # 251 stages through two slots, N below one channel tile
    (3, 8, 33),
    ((5, 12, 20, 20), (50, 1, 1), 1, 0, 1),    # 2000 rows over several images
    ((3, 24, 33, 31), (40, 1, 1), 2, 1, 1),    # stride 2, padding: padded pixels read code 0
    ((70, 9, 3, 3), (65, 1, 1), 1, 0, 1),      # 9-pixel images: a tile spans many
    ((6, 16, 24, 24), (40, 1, 1), 1, 0, 1),    # codes copied by cp.async, 3456 rows: a second tall tile part-full
    (1300, 96, 45),                 # 2 row tiles of 1024, N below 2 channel tiles
    # KxK (implicit im2col, padding tested per tap): N never a multiple of 32, M never of a tile
    ((2, 64, 12, 12), (70, 3, 3), 1, 1, 1),    # 3x3 stride 1 pad 1, K = 576
    ((5, 20, 31, 29), (33, 3, 3), 2, 1, 1),    # 3x3 stride 2 pad 1, 1200 rows
    ((4, 3, 40, 38), (64, 7, 7), 2, 3, 1),     # the 7x7 stem's geometry: C = 3, K = 147 (not % 4)
    ((2, 6, 17, 19), (40, 5, 5), 1, 2, 2),     # 5x5 pad 2 dilation 2
    ((3, 8, 20, 18), (36, 3, 1), 1, (1, 0), 1),             # 3x1
    ((3, 7, 19, 22), (20, 1, 3), (2, 1), (0, 1), (1, 3)),   # 1x3, uneven stride and dilation
    ((2, 5, 6, 7), (20, 3, 3), 1, 4, 1),       # padding past the kernel's reach: whole rows of code 0
    ((1, 512, 7, 7), (40, 3, 3), 1, 1, 1),     # ResNet-50 layer4's K = 4608: 1152 stages, 49 rows
    ((9, 16, 30, 30), (24, 2, 2), 2, 0, 1),    # 2x2 stride 2: 2025 rows, 3 tiles of r8
    # r8c stages a stage's rows one stage ahead of its table: stage counts 1, 2 and 3 with the
    # last stage partial, and a K of 2 (the first stage's second tap pair all past K)
    (1500, 3, 40),
    (1030, 2, 97),                  # 4 channel tiles, the last with 1 channel
    (2100, 6, 64),                  # 3 row tiles, the last with 52 rows; N a multiple of 32
    (600, 11, 31),
    ((4, 13, 17, 15), (33, 1, 1), 2, 2, 1),    # 1x1 conv, stride 2, padding 2: whole padded rows and columns
    # the tall tile (r16c: 2048 rows x 16 channels): 3 row tiles, the last with 104 rows (past M in a
    # live group of 4 rows a thread); a KxK conv over 2 tiles with 5 channel tiles, the last of 1 channel
    (4200, 37, 40),
    ((3, 16, 30, 30), (65, 3, 3), 1, 1, 1),
    # r8c copies a stage's codes with cp.async at a 1x1 stride 1 conv without padding, H W % 4 == 0 and C % 4 == 0:
    # 14x14 planes (tiles across images, not 16-aligned), the last tile partial; 2 tiles of 64 stages
    ((6, 20, 14, 14), (36, 1, 1), 1, 0, 1),
    ((2, 256, 28, 28), (40, 1, 1), 1, 0, 1),
    # r13c's 1664 rows: 3.25 rows a thread staged, so a thread's last staged row is past the tile for some; 3 tiles
    # of 1,136 rows, the last 1,128 (as given), and of 1,120 (codes copied by cp.async: a tile's copies end at its
    # last row, not at 1664); 2 of 1,360 rows on the KxK conv above
    (3400, 37, 40),
    ((4, 16, 28, 30), (36, 1, 1), 1, 0, 1),
]


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("lutkind", ["int16", "wide"])
@pytest.mark.parametrize("case", range(len(GEMM_CASES)))
def test_every_gemm_configuration(case, lutkind, signed):
    """auto times expanded_gemm at 2, 4 and 8 rows a thread (row tiles of 256, 512, 1024) and
    r8w (R = 8, weight bytes loaded once a half stage) and r8c (R = 8, Et16 lines copied whole into a
    staging area, then transposed into the slot), r16c (2048 rows x 16 channels, half the build a product), r13c
    (1664 rows x 16 channels; a call's tall tiles share its rows equally, so most tiles end off a multiple of 128
    rows), and r8c, r16c and r13c with K split (blocks of a split add their sums
    into the zeroed output: the poison must not show; 3 splits leave uneven shares, 64 more splits than
    most cases have stages, so some get none), so each must be exact:
    int16 products (shared-memory table slices) and int32 ones (the E32 path); linear layers,
    1x1 convs and KxK convs (their own kernel instantiation)."""
    shape = GEMM_CASES[case]
    gen = torch.Generator().manual_seed(500 + case * 4 + (lutkind == "wide") * 2 + signed)
    lut = make_lut(gen, lutkind)
    if isinstance(shape[0], tuple):
        (b, c, h, wd_), (n, kh, kw), stride, pad, dil = shape
        a, w = make_codes(gen, (b, c, h, wd_), signed), make_weights(gen, (n, c, kh, kw), signed)
        want = reference_lut_conv2d(a, w, lut, stride, pad, dil, 1)
        args = (_pair(stride), _pair(pad), _pair(dil), 1)
        call = lambda ad, wd, ld, algo: ops.lut_conv2d(ad, wd, ld, *args, algo)  # noqa: E731
    else:
        m, k, n = shape
        a, w = make_codes(gen, (m, k), signed), make_weights(gen, (n, k), signed)
        want = reference_lut_linear(a, w, lut)
        call = lambda ad, wd, ld, algo: ops.lut_linear(ad, wd, ld, algo)  # noqa: E731
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    for algo in ("expanded_gemm", "expanded_gemm_r2", "expanded_gemm_r4", "expanded_gemm_r8", "expanded_gemm_r8w",
                 "expanded_gemm_r8c", "expanded_gemm_r8c_k2", "expanded_gemm_r8c_k3", "expanded_gemm_r8c_k64",
                 "expanded_gemm_r16c", "expanded_gemm_r16c_k2", "expanded_gemm_r16c_k3", "expanded_gemm_r16c_k64",
                 "expanded_gemm_r13c", "expanded_gemm_r13c_k2", "expanded_gemm_r13c_k3"):
        got = poisoned_call(lambda: call(ad, wd, ld, algo), tuple(want.shape))
        check_equal(got, want, f"{shape} {lutkind} signed={signed} {algo}")


def test_auto_times_splits_of_few_stages_where_tiles_leave_sms_idle():
    """Where a tile's blocks leave SMs idle, auto also times K splits of 4, 2 and 1 stages a split (short K at small
    batches: MobileNetV2's 1x1 convs at batch 8 ran up to 1.36x faster than at the wave model's 8 or more); with
    blocks for every SM it times none of them. Every candidate it names runs and gives the reference sums."""
    gen = torch.Generator().manual_seed(71)
    lut = make_lut(gen, "int16")
    a, w = make_codes(gen, (2000, 144), True), make_weights(gen, (32, 144), True)  # 36 stages, a few blocks a tile
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    cands = ops.lut_auto_candidates(ad, wd, ld)
    for tile in ("r8c", "r16c", "r13c"):
        assert {f"expanded_gemm_{tile}_k{ks}" for ks in (9, 18, 36)} <= set(cands), (tile, cands)
    want = reference_lut_linear(a, w, lut)
    for algo in cands:
        check_equal(poisoned_call(lambda: ops.lut_linear(ad, wd, ld, algo), tuple(want.shape)), want, algo)
    many = make_codes(gen, (200_000, 144), True).to(DEV)  # hundreds of blocks a tile
    assert not [c for c in ops.lut_auto_candidates(many, wd, ld) if c.endswith(("_k9", "_k18", "_k36"))]


def test_gemm_declines():
    lut = torch.zeros((256, 256), dtype=torch.int32, device=DEV)
    a = torch.zeros((4, 8), dtype=torch.int8, device=DEV)
    for bad in ("expanded_gemm_r3", "expanded_gemm_r16", "expanded_gemm_r8x", "expanded_gemm_r4w",
                "expanded_gemm_r8ww", "expanded_gemm_r4c", "expanded_gemm_r8cw", "expanded_gemm_r8c_",
                "expanded_gemm_r8c_k", "expanded_gemm_r8c_k1", "expanded_gemm_r8c_k65", "expanded_gemm_r8c_k02",
                "expanded_gemm_r8c_k2x", "expanded_gemm_r8w_k2", "expanded_gemm_r4_k2", "expanded_gemm_r16w",
                "expanded_gemm_r16c_k1", "expanded_gemm_r16c_k65", "expanded_gemm_r32c", "expanded_gemm_r13",
                "expanded_gemm_r13c_k1", "expanded_gemm_r12c"):
        with pytest.raises(RuntimeError, match="bad algo"):
            ops.lut_linear(a, torch.zeros((3, 8), dtype=torch.int8, device=DEV), lut, bad)
    with pytest.raises(RuntimeError, match="unknown algo"):  # a split names its tile: r8c_k<ks>
        ops.lut_linear(a, torch.zeros((3, 8), dtype=torch.int8, device=DEV), lut, "expanded_gemm_k2")
    x = torch.zeros((1, 4, 6, 6), dtype=torch.uint8, device=DEV)
    for kh in (1, 3):  # grouped 1x1 and 3x3
        with pytest.raises(RuntimeError, match="expanded_gemm.*conv of one group"):
            ops.lut_conv2d(x, torch.zeros((4, 2, kh, kh), dtype=torch.int8, device=DEV), lut, [1, 1], [0, 0], [1, 1],
                           2, "expanded_gemm")


LAYOUTS = [
    # (B, C, H, W), (N, kh, kw), stride, padding, dilation, the layout auto runs it in (lut_ops.cpp's gemm_layout):
    # a conv of one group at >= 2048 output rows, K a multiple of 4, as a stride-1 1x1 conv over its taps
    ((8, 24, 33, 31), (40, 1, 1), 2, 0, 1, "taps"),        # odd sizes: the last sampled row and column the input's
    ((12, 16, 20, 18), (36, 1, 1), (2, 1), 0, 1, "taps"),  # sampled in one dimension
    ((44, 20, 7, 7), (44, 1, 1), 1, 0, 1, "folded"),       # 49-pixel planes, 2156 rows: one image of [C, 44 x 49]
    ((48, 12, 14, 14), (28, 1, 1), 2, 0, 1, "folded"),     # sampled to 7x7, then folded: 2352 rows
    ((46, 12, 7, 7), (20, 1, 1), 1, 0, 1, "given"),        # 2254 rows: not a multiple of 4
    ((40, 12, 7, 7), (24, 1, 1), 1, 0, 1, "given"),        # 1960 rows: less than two tiles
    ((2, 8, 20, 20), (12, 1, 1), 2, 0, 1, "given"),        # strided, 200 rows
    ((40, 12, 8, 8), (20, 1, 1), 1, 0, 1, "given"),        # planes of a multiple of 4 already
    ((10, 8, 16, 16), (36, 3, 3), 1, 1, 1, "timed"),       # 3x3, stride 1, 16x16 planes: taps or as given
    ((12, 12, 31, 29), (20, 3, 3), 2, 1, 1, "taps"),       # stride 2: im2col, padded taps code 0; 16x15 planes
    ((3, 4, 30, 34), (9, 5, 5), 1, (2, 3), 2, "taps"),     # 5x5, dilation 2, uneven padding: 26x32 planes
    # the taps are copied a plane a block (64, 128 or 512 threads by its output words), its rows into their padded
    # span in shared memory (rows of 4-byte words at 32x32, of bytes at 31x29 and 30x34; output rows of whole words
    # taken a word column a thread at stride 1 and 2 (26x32, 16x16, and 44x44 of 49 taps: more word columns than
    # threads), other words one by one, shifted out of the span's words from two rows where a word crosses one (14x14,
    # 16x15), byte by byte at stride 3), and by words where the span passes 48 KiB
    ((8, 8, 46, 46), (12, 3, 3), 3, 1, 1, "taps"),
    ((8, 8, 32, 32), (16, 3, 3), 2, 1, 1, "taps"),
    ((12, 8, 16, 16), (20, 3, 3), 1, 1, 2, "taps"),
    ((2, 4, 56, 56), (10, 7, 7), 1, 0, 2, "taps"),
    ((1, 4, 248, 248), (8, 3, 3), 2, 1, 1, "taps"),
    ((44, 16, 7, 7), (40, 3, 3), 1, 1, 1, "folded"),       # ResNet-50 layer4's 3x3 geometry, 2156 rows
    ((48, 8, 13, 13), (12, 3, 3), 2, 1, 1, "folded"),      # strided to 7x7, then folded
    ((12, 6, 16, 16), (12, 3, 3), 1, 1, 1, "given"),       # K = 54: not a multiple of 4
    ((4, 3, 48, 48), (16, 7, 7), 2, 3, 1, "given"),        # the stem's K = 147
    ((7, 8, 16, 16), (12, 3, 3), 1, 1, 1, "given"),        # 1792 rows: less than two tiles
    ((46, 8, 7, 7), (12, 3, 3), 1, 1, 1, "given"),         # 2254 rows of 49-pixel planes: not foldable
]


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("case", range(len(LAYOUTS)))
def test_auto_runs_convs_in_its_gemm_layout(case, signed):
    """auto runs a conv of one group as expanded_gemm's stride-1 1x1 conv over its taps, whose codes it copies with
    cp.async: a strided 1x1 conv's sampled codes, a strided or dilated KxK conv's im2col, 7x7-like planes with the
    batch folded into one image; a KxK conv of stride 1 on other planes either way, the taps timed against the
    shapes as given on the first call. The sums are the reference's, on the first call and on the next, and auto's
    pick is recorded for the layout it ran in (the shapes' own entry is what tells that the layout was taken: each
    case's channel counts are its own); a timed conv's for both ways."""
    (b, c, h, wd_), (n, kh, kw), stride, pad, dil, layout = LAYOUTS[case]
    gen = torch.Generator().manual_seed(900 + case * 2 + signed)
    lut = make_lut(gen, "int16")
    a, w = make_codes(gen, (b, c, h, wd_), signed), make_weights(gen, (n, c, kh, kw), signed)
    want = reference_lut_conv2d(a, w, lut, stride, pad, dil, 1)
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    got = poisoned_call(lambda: ops.lut_conv2d(ad, wd, ld, _pair(stride), _pair(pad), _pair(dil), 1, "auto"),
                        tuple(want.shape))
    check_equal(got, want, f"{LAYOUTS[case]} signed={signed}")
    got = poisoned_call(lambda: ops.lut_conv2d(ad, wd, ld, _pair(stride), _pair(pad), _pair(dil), 1, "auto"),
                        tuple(want.shape))
    check_equal(got, want, f"{LAYOUTS[case]} signed={signed}, the second call")
    torch.library.opcheck(ops.lut_conv2d.default, (ad, wd, ld, _pair(stride), _pair(pad), _pair(dil), 1, "auto"))
    taps = taps_of(ad, (kh, kw), stride, pad, dil)
    if layout == "folded":
        taps = taps.transpose(0, 1).contiguous().view(1, taps.shape[1], b, -1)

    def pick(x, wx, conv):
        return [r["auto_pick_name"] for r in algo_table(x, wx, ld, *conv, backend="cuda") if r["auto_pick"]]
    given, in_taps = pick(ad, wd, (stride, pad, dil)), pick(taps, wd.view(n, -1, 1, 1), (1, 0, 1))
    if layout == "timed":
        # both ways timed on the first call; lut_algos reports the faster way's pick, which later calls run
        assert in_taps, "the taps were not timed"
        assert given, "auto's pick is not recorded for the shapes as given"
        return
    ran = given if layout == "given" else in_taps
    assert ran, f"auto's pick is not recorded for the {layout} layout"
    # lut_algos reports it for the shapes as given
    assert given == ran


LINEAR_LAYOUTS = [
    # (M, K, N), whether auto runs it transposed (lut_ops.cpp's linear_layout): >= 2048 rows, M and K multiples of 4,
    # the codes [K, M] as one image of H x W = M pixels, W = 4 gcd(M / 4, 4096)
    ((2048, 64, 40), True),        # two tiles exactly: 1 x 2048
    ((12608, 96, 72), True),       # ViT-B/16's rows at batch 64: 197 x 64
    ((4100, 36, 20), True),        # M / 4 odd: 1025 x 4
    ((2050, 64, 44), False),       # M not a multiple of 4
    ((4096, 38, 48), False),       # K not a multiple of 4
    ((2044, 64, 52), False),       # less than two tiles
    ((131076, 4, 12), False),      # 32769 x 4: the plane's height past conv_params' bound
]


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("case", range(len(LINEAR_LAYOUTS)))
def test_auto_runs_linear_layers_transposed(case, signed):
    """auto runs a linear layer of >= 2 row tiles, M and K multiples of 4, as expanded_gemm's stride-1 1x1 conv of
    one image over its transposed codes, copied with cp.async, the sums transposed back. The sums are the
    reference's, opcheck passes, and auto's pick is recorded for the shapes it ran in (each case's N is its own)."""
    (m, k, n), transposed = LINEAR_LAYOUTS[case]
    gen = torch.Generator().manual_seed(950 + case * 2 + signed)
    lut = make_lut(gen, "int16")
    a, w = make_codes(gen, (m, k), signed), make_weights(gen, (n, k), signed)
    want = reference_lut_linear(a, w, lut)
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    got = poisoned_call(lambda: ops.lut_linear(ad, wd, ld, "auto"), tuple(want.shape))
    check_equal(got, want, f"{LINEAR_LAYOUTS[case]} signed={signed}")
    torch.library.opcheck(ops.lut_linear.default, (ad, wd, ld, "auto"))

    def pick(x, wx, *conv):
        return [r["auto_pick_name"] for r in algo_table(x, wx, ld, *conv, backend="cuda") if r["auto_pick"]]
    given = pick(ad, wd)
    assert given, "auto's pick is not recorded"
    width = 4 * math.gcd(m // 4, 4096) if m % 4 == 0 else 0
    if width and m // width < 32768:  # a plane the conv kernels take: asked for, it has no pick unless auto ran it
        as_conv = pick(ad.t().contiguous().view(1, k, m // width, width), wd.view(n, k, 1, 1), 1, 0, 1)
        assert as_conv == (given if transposed else []), f"transposed={transposed}: {as_conv} against {given}"
