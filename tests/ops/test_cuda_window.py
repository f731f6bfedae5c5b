"""CUDA expanded_window on the model zoo's conv shapes (3x3 stride 1 and 2, 1x1 stride 1 and 2, 3-channel
stems, 32x32 inputs, many channels on small planes): bit-exact against the python reference, with every
channel-chunk size its staging can take (expanded_window_c<channels>) and 8, 7 or 5 outputs a thread
(expanded_window_x<n>), and the zoo's real layer shapes at batch 256 against the CPU kernel.

Marked `cuda` (deselected by default; run with `-m cuda` on a GPU machine)."""
import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.ops.test_cuda import (  # noqa: E402  (skips itself without CUDA kernels)
    DEV, _has_cpu, _pair, check_equal, make_codes, make_lut, make_weights, poisoned_call)

from runner.ops import algo_table  # noqa: E402
from runner.reference import reference_lut_conv2d  # noqa: E402

ops = torch.ops.approx

# (B, C, H, W), (N, kh, kw), stride, padding, groups
CASES = {
    "3x3_s2": ((3, 6, 13, 11), (10, 3, 3), 2, 1, 1),         # odd planes: the last column pair half outside
    "3x3_s2_32": ((2, 16, 32, 32), (32, 3, 3), 2, 1, 1),     # ResNet stage 2's first conv
    "1x1_s2": ((3, 32, 16, 16), (64, 1, 1), 2, 0, 1),        # ResNet shortcut
    "1x1": ((2, 16, 8, 8), (96, 1, 1), 1, 0, 1),             # MobileNetV2 expand
    "1x1_g2_sw2": ((2, 4, 11, 13), (6, 1, 1), (1, 2), 0, 2),  # row stride 1, column stride 2, groups
    "1x1_c12": ((3, 12, 7, 9), (10, 1, 1), 1, 0, 1),          # 4 channels a table chunk, K 12 (not whole 8s)
    "1x1_c6": ((2, 6, 5, 5), (8, 1, 1), 1, 0, 1),             # 6 channels: one a chunk
    "3x1_s2": ((3, 5, 9, 10), (7, 3, 1), 2, (1, 0), 1),      # kh 3, kw 1
    "stem": ((2, 3, 32, 32), (16, 3, 3), 1, 1, 1),           # 3-channel stem, 32x32
    "dw_s2": ((2, 24, 16, 16), (24, 3, 3), 2, 1, 24),        # depthwise, stride 2
    "5x5_wide": ((2, 3, 12, 21), (9, 5, 5), 1, 2, 1),        # 21 outputs a row: 7 a thread, unaligned starts
    "lenet_classic_conv2": ((3, 6, 14, 14), (16, 5, 5), 1, 0, 1),  # 10 outputs a row: 5 a thread
    "3x3_wo14": ((2, 16, 14, 14), (32, 3, 3), 1, 1, 1),      # ResNet on 28x28, stage 2: 7 a thread
    # 8x8 planes, 64 channels: 33 images a block, whose planes do not fit shared memory at once
    "8x8_c64": ((34, 64, 8, 8), (16, 3, 3), 1, 1, 1),
}


def _args(stride, padding, groups):
    return _pair(stride), _pair(padding), [1, 1], groups


def _window_applies(a, w, lut, args):
    rows = algo_table(a, w, lut, args[0], args[1], args[2], args[3], backend="cuda")
    return {r["algo"]: r for r in rows}["expanded_window"]


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("lutkind", ["int16", "wide"])
@pytest.mark.parametrize("case", list(CASES))
def test_window_every_channel_chunk(case, lutkind, signed):
    """The planes staged 1, 2, 3, ... channels at a time (restaged inside the tap loop), all at once, and
    auto, the default and `expanded`: every one equal to the reference."""
    (b, c, h, wd_), (n, kh, kw), stride, padding, groups = CASES[case]
    gen = torch.Generator().manual_seed(list(CASES).index(case) * 4 + (lutkind == "wide") * 2 + signed)
    a = make_codes(gen, (b, c, h, wd_), signed)
    w = make_weights(gen, (n, c // groups, kh, kw), signed)
    lut = make_lut(gen, lutkind)
    args = _args(stride, padding, groups)
    want = reference_lut_conv2d(a, w, lut, *args)
    ad, wdv, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    row = _window_applies(ad, wdv, ld, args)
    assert row["applies"], f"{case}: {row['note']}"
    cg = c // groups
    chunks = sorted({1, 2, 3, max(1, cg // 2), cg, cg + 5})
    algos = ["expanded_window", "expanded", "auto", *(f"expanded_window_c{k}" for k in chunks)]
    if kw in (3, 5) and _pair(stride)[1] == 1:  # 7 and 5 outputs a thread (unaligned rows, scalar stores)
        algos += ["expanded_window_x7", "expanded_window_x5", "expanded_window_x7_c1", "expanded_window_x5_c2",
                  "expanded_window_x8_c3"]
    for algo in algos:
        got = poisoned_call(lambda: ops.lut_conv2d(ad, wdv, ld, *args, algo), tuple(want.shape))
        check_equal(got, want, f"{case} {lutkind} signed={signed} algo={algo}")


def test_window_bad_channel_chunk_names():
    a = torch.zeros((1, 4, 6, 6), dtype=torch.uint8, device=DEV)
    w = torch.zeros((8, 4, 3, 3), dtype=torch.int8, device=DEV)
    lut = torch.zeros((256, 256), dtype=torch.int32, device=DEV)
    for bad in ("expanded_window_c0", "expanded_window_cx", "expanded_window_c2x", "expanded_window_c",
                "expanded_window_", "expanded_window_x6", "expanded_window_x7_c0", "expanded_window_x7c2"):
        with pytest.raises(RuntimeError, match="bad algo"):
            ops.lut_conv2d(a, w, lut, [1, 1], [1, 1], [1, 1], 1, bad)


def test_window_refuses_what_it_does_not_run():
    """Dilation, stride 3, and 5-wide kernels at stride 2 stay with the other variants."""
    a = torch.zeros((1, 4, 12, 12), dtype=torch.uint8, device=DEV)
    lut = torch.zeros((256, 256), dtype=torch.int32, device=DEV)
    for (kh, kw), stride, dilation in (((3, 3), 3, 1), ((3, 3), 1, 2), ((5, 5), 2, 1)):
        w = torch.zeros((8, 4, kh, kw), dtype=torch.int8, device=DEV)
        row = _window_applies(a, w, lut, ([stride] * 2, [1, 1], [dilation] * 2, 1))
        assert not row["applies"] and "dilation 1" in row["note"]
        with pytest.raises(RuntimeError, match="expanded_window"):
            ops.lut_conv2d(a, w, lut, [stride] * 2, [1, 1], [dilation] * 2, 1, "expanded_window")


# The zoo's conv shapes on 3x32x32 inputs (resnet20, vgg, mobilenetv2), per image: (C, H, W), (N, kh, kw),
# stride, padding, groups
ZOO = {
    "resnet_stem": ((3, 32, 32), (16, 3, 3), 1, 1, 1),
    "resnet_l1": ((16, 32, 32), (16, 3, 3), 1, 1, 1),
    "resnet_l2_s2": ((16, 32, 32), (32, 3, 3), 2, 1, 1),
    "resnet_l2": ((32, 16, 16), (32, 3, 3), 1, 1, 1),
    "resnet_l3_short": ((32, 16, 16), (64, 1, 1), 2, 0, 1),
    "resnet_l3": ((64, 8, 8), (64, 3, 3), 1, 1, 1),
    "vgg_128": ((128, 8, 8), (128, 3, 3), 1, 1, 1),
    "mbv2_expand": ((24, 16, 16), (144, 1, 1), 1, 0, 1),
    "mbv2_dw_s2": ((144, 16, 16), (144, 3, 3), 2, 1, 144),
    "mbv2_project": ((144, 8, 8), (32, 1, 1), 1, 0, 1),
}


@pytest.mark.parametrize("layer", list(ZOO))
def test_zoo_layer_shapes_batch256(layer):
    """Every variant that runs the shape, and auto, equal to the CPU kernel on the whole batch (to the
    reference on the first 8 images where the CPU kernels are absent); ReLU-like codes, int16 table."""
    ashape, (n, kh, kw), stride, padding, groups = ZOO[layer]
    gen = torch.Generator().manual_seed(100 + list(ZOO).index(layer))
    a = make_codes(gen, (256, *ashape), False)
    a[torch.rand(a.shape, generator=gen) < 0.5] = 0
    w = make_weights(gen, (n, ashape[0] // groups, kh, kw), False)
    lut = make_lut(gen, "int16")
    args = _args(stride, padding, groups)
    head = reference_lut_conv2d(a[:8], w, lut, *args)
    full = ops.lut_conv2d(a, w, lut, *args, "auto") if _has_cpu() else None
    ad, wdv, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    algos = ["auto"] + [r["algo"] for r in algo_table(ad, wdv, ld, *args, backend="cuda") if r["applies"]]
    for algo in algos:
        got = ops.lut_conv2d(ad, wdv, ld, *args, algo)
        check_equal(got[:8], head, f"{layer} algo={algo} vs reference (first 8)")
        if full is not None:
            check_equal(got, full, f"{layer} algo={algo} vs CPU kernel")
