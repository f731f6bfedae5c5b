"""CUDA depthwise variants on 3x3 depthwise shapes (MobileNetV2's): bit-exact against the python
reference with poisoned outputs, every variant approx::lut_algos says applies (depthwise_rows' four
among them), stride 1 and 2, padding 0 and 1; rows a multiple of 4 wide (window words loaded from global
memory; in 8-byte pairs where rows are a multiple of 8 wide and a task's 8 or 16 columns start every window
on the same word of a pair), other rows of inputs a multiple of 4 bytes (words at byte offsets, edge columns
masked; at stride 2 from aligned 16-byte quads where the input is a whole number of them), inputs of other
sizes or off a word boundary (rows staged byte-wise in shared memory); int16 and int32 products, signed and
unsigned codes; which shapes depthwise_rows takes; and the blocks a channel (_g<N>) auto times. Where a case's
comment names a load, the case's sizes select it (depthwise_rows.cu, dr_geo). depthwise_planes (7x7 planes at
stride 1, 14x14 and 28x28 at stride 2): every configuration on whole and partial warps and blocks, inputs off a
word, its names and the shapes it takes.

Marked `cuda` (deselected by default; run with `-m cuda` on a GPU machine)."""

import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from tests.ops.test_cuda import (  # noqa: E402  (skips itself without CUDA kernels)
    ALGOS, DEV, EXERCISED, NO_CACHING, _pair, _reported_pick, alloc_blocks, check_equal, kept_by_first_call, make_codes,
    make_lut, make_weights, poisoned_call)

from runner.ops import algo_table  # noqa: E402
from runner.reference import reference_lut_conv2d  # noqa: E402

ops = torch.ops.approx

# (B, C, H, W), stride, padding; weights (C, 1, 3, 3), groups C
CASES = {
    "7x7": ((2, 3, 7, 7), 1, 1),                # 7 outputs a row: 7 a thread; a tile spans images
    "7x7_s2": ((2, 3, 7, 7), 2, 1),
    "13x11": ((1, 4, 13, 11), 1, 0),            # odd plane: tiles end mid-row
    "13x11_s2": ((1, 4, 13, 11), 2, 0),
    "13x11_s2_p1": ((3, 2, 13, 11), 2, 1),      # 858 bytes, not a multiple of 4: rows staged in shared memory
    "112": ((2, 2, 112, 112), 1, 1),            # MobileNetV2's first depthwise layer (8-byte pairs)
    "112_s2": ((2, 2, 112, 112), 2, 1),         # 8-byte pairs, windows from a pair's second word
    "28": ((3, 5, 28, 28), 1, 1),
    "14_s2_b37": ((37, 3, 14, 14), 2, 1),       # 7x7 outputs: a tile spans 36 images
    "4x3_b40": ((40, 2, 4, 3), 1, 1),           # planes smaller than the kernel's reach
    "1x1": ((5, 2, 1, 1), 1, 1),                # one output per image, all padding but the centre
    "wide_s2": ((2, 1, 9, 600), 2, 1),          # rows wider than a tile's 256 tasks
    "pad_y": ((2, 3, 9, 9), 1, (1, 0)),         # padding along y only
    # rows a multiple of 4 wide: whole words of one row each
    "16_p0": ((2, 3, 12, 16), 1, 0),
    "20_s2_p0": ((3, 2, 11, 20), 2, 0),
    "pad_x": ((2, 3, 9, 8), 1, (0, 1)),         # padding along x only; 8-byte pairs, one a row
    "32_p0": ((2, 3, 6, 32), 1, 0),             # 8-byte pairs, windows from a pair's first word
    "24_s2_p0": ((3, 2, 9, 24), 2, 0),          # the same at stride 2 (16 columns a task)
    "wide_s1": ((1, 2, 5, 1200), 1, 1),
    "56_b9": ((9, 2, 56, 56), 1, 1),            # many tiles a block
    "56_s2_b9": ((9, 2, 56, 56), 2, 1),         # 7 outputs a thread: 14 columns, single words
    "84": ((2, 2, 84, 84), 1, 1),               # 7 outputs a thread (84 = 12 x 7) on word rows
    "28_s2_b12": ((12, 3, 28, 28), 2, 1),       # a tile spans 9 images
    # other rows of planes a multiple of 4 bytes: words at byte offsets, the columns outside the row masked
    "14": ((5, 3, 14, 14), 1, 1),               # MobileNetV2's 14x14 layers
    "14_p0": ((3, 2, 14, 14), 1, 0),
    "14_s2_q": ((4, 4, 14, 14), 2, 1),          # MobileNetV2's 14x14 stride-2 layer: 3,136 bytes, quads
    "10x6_s2": ((4, 2, 10, 6), 2, 1),           # quads, 8 outputs a thread (17 columns: 6 words from 3 quads)
    "6x10_pad_x": ((3, 2, 6, 10), 1, (0, 1)),
    "6x10_pad_y_s2": ((3, 2, 6, 10), 2, (1, 0)),
    # images a multiple of 4 bytes, planes not: each channel's planes 0-3 bytes into a word; the input's first
    # and last words (a window at row -1, column -1 of image 0's channel 0 starts before the input)
    "7x7_c8": ((3, 8, 7, 7), 1, 1),
    "7x7_c16_s2": ((2, 16, 7, 7), 2, 1),        # quads, the input's first and last ones among them
    "7x7_c4_s2_b37": ((37, 4, 7, 7), 2, 1),
    "5x3_c4_p0": ((4, 4, 5, 3), 1, 0),
    "9x9_c4_pad_y": ((2, 4, 9, 9), 1, (1, 0)),
    "30_c4": ((2, 4, 30, 30), 1, 1),            # a tile covers part of a plane
}


def _rows_variants(stride):
    """depthwise_rows' variants that run at this stride (the split table at stride 2 only)."""
    return ("depthwise_rows", "depthwise_rows_banked", "depthwise_rows_banked8") + (
        ("depthwise_rows_split",) if stride == 2 else ()
    )


# depthwise_planes' configurations by (stride, plane side): the default and each (bands, images a block[, bands a
# block]); at 28x28 every band but the first and the last runs band 1's code on shifted rows (bands of 2 output
# rows, and of 3 with a short last band)
PLANES = {(1, 7): ("depthwise_planes", "depthwise_planes_b1_i64", "depthwise_planes_b1_i32"),
          (2, 14): ("depthwise_planes", "depthwise_planes_b1_i64", "depthwise_planes_b2_i32",
                    "depthwise_planes_b1_i128"),
          (2, 28): ("depthwise_planes", "depthwise_planes_b7_i32_bb7", "depthwise_planes_b5_i32_bb5")}


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("lutkind", ["int16", "wide"])
@pytest.mark.parametrize("case", list(CASES))
def test_depthwise_3x3_matches_reference(case, lutkind, signed):
    (b, c, h, wd_), stride, padding = CASES[case]
    gen = torch.Generator().manual_seed(4000 + list(CASES).index(case) * 4 + (lutkind == "wide") * 2 + signed)
    a = make_codes(gen, (b, c, h, wd_), signed)
    w = make_weights(gen, (c, 1, 3, 3), signed)
    lut = make_lut(gen, lutkind)
    want = reference_lut_conv2d(a, w, lut, stride, padding, 1, c)
    args = (_pair(stride), _pair(padding), [1, 1], c)
    ad, wdv, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    applies = [r["algo"] for r in algo_table(ad, wdv, ld, *args, backend="cuda") if r["applies"]]
    assert set(_rows_variants(1)) <= set(applies)
    assert ("depthwise_rows_split" in applies) == (stride == 2)
    algos = list(dict.fromkeys(ALGOS + applies))
    EXERCISED.update(algos)
    for algo in algos:
        got = poisoned_call(lambda: ops.lut_conv2d(ad, wdv, ld, *args, algo), tuple(want.shape))
        check_equal(got, want, f"lut_conv2d {case} {lutkind} signed={signed} algo={algo}")


@pytest.mark.parametrize("hw", [16, 14, 7])
@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_depthwise_rows_input_off_a_word_boundary(offset, hw):
    """Window words are loaded from global memory only where the input starts on a word: codes at a
    byte offset (a view into a larger buffer) of 1 or 2 take the rows staged byte-wise, of 4 single words
    (16-wide rows: not 8-byte pairs, which need an input on 8 bytes), of 8 pairs again (14- and 7-wide rows at
    stride 2: single words, where an input on 16 bytes takes 16-byte quads); all exactly. depthwise_planes reads
    whole words too: off a word it runs depthwise_rows' single table."""
    gen = torch.Generator().manual_seed(33 + offset + hw)
    shape = (3, 4, hw, hw)
    a = make_codes(gen, shape, True)
    w = make_weights(gen, (4, 1, 3, 3), True)
    lut = make_lut(gen, "int16")
    buf = torch.zeros(a.numel() + offset, dtype=a.dtype, device=DEV)
    ad = buf[offset:].view(shape)
    ad.copy_(a.to(DEV))
    for stride in (1, 2):
        want = reference_lut_conv2d(a, w, lut, stride, 1, 1, 4)
        args = ([stride, stride], [1, 1], [1, 1], 4)
        for algo in _rows_variants(stride) + PLANES.get((stride, hw), ()):
            got = poisoned_call(lambda: ops.lut_conv2d(ad, w.to(DEV), lut.to(DEV), *args, algo), tuple(want.shape))
            check_equal(got, want, f"{algo} stride {stride}, input at byte offset {offset}")


def _against_direct(seed, batch, channels, hw, stride):
    """Signed codes and weights of a padded 3x3 depthwise conv on the device, and `direct`'s sums on the host."""
    gen = torch.Generator().manual_seed(seed)
    a = make_codes(gen, (batch, channels, hw, hw), True).to(DEV)
    w = make_weights(gen, (channels, 1, 3, 3), True).to(DEV)
    lut = make_lut(gen, "int16").to(DEV)
    args = ([stride, stride], [1, 1], [1, 1], channels)
    return a, w, lut, args, ops.lut_conv2d(a, w, lut, *args, "direct").cpu()


@pytest.mark.parametrize("batch,stride,hw", [(2, 1, 56), (8, 2, 56), (64, 1, 28), (64, 2, 28), (64, 1, 14), (64, 2, 14),
                                             (64, 1, 7)])
def test_depthwise_rows_blocks_of_many_tiles(batch, stride, hw):
    """With hundreds of channels a block walks more than one tile of its channel, the table built once:
    against `direct` (itself checked against the reference)."""
    a, w, lut, args, want = _against_direct(40 + stride + hw, batch, 300, hw, stride)
    for algo in _rows_variants(stride):
        got = poisoned_call(lambda: ops.lut_conv2d(a, w, lut, *args, algo), tuple(want.shape))
        check_equal(got, want, f"{algo} stride {stride}, 300 channels")


def test_depthwise_rows_shapes_and_auto_with_int32_products():
    """depthwise_rows runs 3x3 depthwise convs of dilation 1 at stride 1 or 2 with padding <= 1 and
    says why not for every other shape. With int32 products (a 'wide' LUT) an explicit call is
    still exact (16-byte table entries), but auto does not time it there."""
    gen = torch.Generator().manual_seed(31)
    a = make_codes(gen, (4, 6, 15, 15), True)
    ad = a.to(DEV)
    lut16 = make_lut(gen, "int16").to(DEV)

    def row(w, stride=1, padding=1, dilation=1, groups=6):
        rows = algo_table(ad, w.to(DEV), lut16, stride, padding, dilation, groups, backend="cuda")
        return {r["algo"]: r for r in rows}["depthwise_rows"]

    w3, w5 = make_weights(gen, (6, 1, 3, 3), True), make_weights(gen, (6, 1, 5, 5), True)
    for stride in (1, 2):
        for padding in (0, 1, (1, 0)):
            assert row(w3, stride, padding)["applies"], (stride, padding)
    assert "3x3" in row(w5)["note"]
    assert "3x3" in row(w3, dilation=2)["note"]
    assert "stride" in row(w3, stride=3)["note"] and "stride" in row(w3, stride=(1, 2))["note"]
    assert "padding" in row(w3, padding=2)["note"]
    assert "depthwise" in row(make_weights(gen, (6, 2, 3, 3), True), groups=3)["note"]
    rows = algo_table(ad, w3.to(DEV), lut16, 1, 1, 1, 6, backend="cuda")
    split = {r["algo"]: r for r in rows}["depthwise_rows_split"]
    assert not split["applies"] and "stride 2" in split["note"]

    lut32 = make_lut(gen, "wide")
    want = reference_lut_conv2d(a, w3, lut32, 1, 1, 1, 6)
    args = ([1, 1], [1, 1], [1, 1], 6)
    wd, l32 = w3.to(DEV), lut32.to(DEV)
    check_equal(ops.lut_conv2d(ad, wd, l32, *args, "depthwise_rows"), want, "depthwise_rows, int32 products")
    want2 = reference_lut_conv2d(a, w3, lut32, 2, 1, 1, 6)
    got2 = ops.lut_conv2d(ad, wd, l32, [2, 2], [1, 1], [1, 1], 6, "depthwise_rows_split")
    check_equal(got2, want2, "depthwise_rows_split, int32 products")
    check_equal(ops.lut_conv2d(ad, wd, l32, *args, "auto"), want, "auto, int32 products")
    assert _reported_pick(ad, wd, l32, 1, 1, 1, 6) not in ("", "depthwise_rows")


@pytest.mark.parametrize("lutkind", ["int16", "wide"])
def test_depthwise_rows_reads_the_table_format_on_the_device(lutkind):
    """Weights written in place between calls build uncached tables whose format the host does not
    know (Prepared::fmt 0): the kernel reads the fit flags on the device and must stay exact."""
    gen = torch.Generator().manual_seed(32 + (lutkind == "wide"))
    a = make_codes(gen, (3, 4, 13, 11), False)
    w = make_weights(gen, (4, 1, 3, 3), False)
    lut = make_lut(gen, lutkind)
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    for stride in (1, 2):
        want = reference_lut_conv2d(a, w, lut, stride, 1, 1, 4)
        args = ([stride, stride], [1, 1], [1, 1], 4)
        for algo in _rows_variants(stride):
            for _ in range(3):  # the first call caches (format known); later ones see the weights change
                wd.add_(0)
                got = poisoned_call(lambda: ops.lut_conv2d(ad, wd, ld, *args, algo), tuple(want.shape))
                check_equal(got, want, f"{algo} stride {stride} {lutkind}, format read on the device")


@pytest.mark.parametrize("batch,stride,hw", [(9, 1, 14), (9, 2, 28), (3, 1, 56), (40, 1, 7)])
def test_depthwise_rows_blocks_a_channel(batch, stride, hw):
    """A _g<N> name fixes the blocks a channel (auto times 1, 2 and 4 beside the grid model's pick): every grid
    walks each tile of its channel once, N past the channel's tiles included. Against `direct`."""
    a, w, lut, args, want = _against_direct(50 + stride + hw, batch, 40, hw, stride)
    for algo in _rows_variants(stride):
        for gx in (1, 2, 3, 4, 4096):
            name = f"{algo}_g{gx}"
            got = poisoned_call(lambda: ops.lut_conv2d(a, w, lut, *args, name), tuple(want.shape))
            check_equal(got, want, f"{name} stride {stride}, {hw}x{hw}, batch {batch}")


def test_depthwise_rows_grid_names():
    """Malformed grids are errors that name the form; names that are not depthwise_rows' stay unknown."""
    gen = torch.Generator().manual_seed(51)
    a = make_codes(gen, (2, 4, 8, 8), True).to(DEV)
    w = make_weights(gen, (4, 1, 3, 3), True).to(DEV)
    lut = make_lut(gen, "int16").to(DEV)
    args = ([1, 1], [1, 1], [1, 1], 4)
    for bad in ("depthwise_rows_g0", "depthwise_rows_g", "depthwise_rows_g01", "depthwise_rows_g2x",
                "depthwise_rows_g4097", "depthwise_rows_banked8_g-1", "depthwise_rows_split_g12345"):
        with pytest.raises(RuntimeError, match=r"_g<blocks a channel, 1\.\.4096>"):
            ops.lut_conv2d(a, w, lut, *args, bad)
    for unknown in ("depthwise_g2", "depthwise_rows_banked9_g2", "expanded_l2_g2"):
        with pytest.raises(RuntimeError, match="unknown algo"):
            ops.lut_conv2d(a, w, lut, *args, unknown)


@pytest.mark.parametrize("batch,channels,stride,hw", [(64, 40, 2, 14), (37, 24, 2, 14), (1, 8, 2, 14), (70, 33, 1, 7),
                                                     (33, 8, 1, 7), (1, 3, 1, 7), (66, 10, 2, 28), (1, 5, 2, 28),
                                                     (33, 7, 2, 28)])
def test_depthwise_planes_configurations(batch, channels, stride, hw):
    """Every configuration of depthwise_planes (a warp's 32 images, one band of output rows or many) on whole and
    partial warps and blocks, a block's later warps empty among them (batch 1 and 33 with 64 or 128 images a block):
    against `direct`. 7x7 planes start 0-3 bytes into a word (49 bytes a plane); at 28x28 the middle bands run one
    band's code on shifted rows."""
    a, w, lut, args, want = _against_direct(60 + batch + stride, batch, channels, hw, stride)
    for algo in PLANES[(stride, hw)]:
        got = poisoned_call(lambda: ops.lut_conv2d(a, w, lut, *args, algo), tuple(want.shape))
        check_equal(got, want, f"{algo}, batch {batch}, {channels} channels")


@pytest.mark.parametrize("stride,hw", sorted(PLANES))
def test_depthwise_planes_configurations_are_autos_candidates(stride, hw):
    """auto times every depthwise_planes configuration built for the plane, by the names a named call runs, and none
    where the products need int32 (depthwise_rows' single table runs those)."""
    gen = torch.Generator().manual_seed(63)
    a = make_codes(gen, (4, 8, hw, hw), True).to(DEV)
    w = make_weights(gen, (8, 1, 3, 3), True).to(DEV)
    args = ([stride] * 2, [1, 1], [1, 1], 8)
    cands = ops.lut_auto_candidates(a, w, make_lut(gen, "int16").to(DEV), *args)
    assert [c for c in cands if c.startswith("depthwise_planes")] == list(PLANES[(stride, hw)][1:])
    wide = ops.lut_auto_candidates(a, w, make_lut(gen, "wide").to(DEV), *args)
    assert wide and not [c for c in wide if c.startswith("depthwise_planes")]


def test_depthwise_planes_shapes_and_names():
    """depthwise_planes takes 3x3 convs of padding 1 on 7x7 planes at stride 1 and 14x14 or 28x28 ones at stride 2
    and says why not for others; its configuration names are checked against the ones built, and for the shape;
    auto's pick is reported by a name that runs."""
    gen = torch.Generator().manual_seed(61)
    lut = make_lut(gen, "int16").to(DEV)
    w = make_weights(gen, (4, 1, 3, 3), True).to(DEV)

    def row(hw, stride, padding=1):
        a = make_codes(gen, (2, 4, hw, hw), True).to(DEV)
        rows = algo_table(a, w, lut, stride, padding, 1, 4, backend="cuda")
        return {r["algo"]: r for r in rows}["depthwise_planes"]

    assert all(row(hw, stride)["applies"] for stride, hw in PLANES)
    for hw, stride in ((14, 1), (7, 2), (28, 1), (56, 2), (8, 1)):
        assert "built: 7x7 at stride 1, 14x14 or 28x28 at stride 2" in row(hw, stride)["note"], (hw, stride)
    assert "padding 1" in row(14, 2, 0)["note"]
    a7 = make_codes(gen, (3, 4, 7, 7), True).to(DEV)
    args = ([1, 1], [1, 1], [1, 1], 4)
    for bad in ("depthwise_planes_b3_i32", "depthwise_planes_b2", "depthwise_planes_b2_i32x", "depthwise_planes_",
                "depthwise_planes_b7_i32", "depthwise_planes_b7_i32_bb", "depthwise_planes_b7_i32_bb07",
                "depthwise_planes_b+1_i64", "depthwise_planes_b1_i64_bb1", "depthwise_planes_b28_i32_bb4_"):
        with pytest.raises(RuntimeError, match=r"depthwise_planes_b<bands>_i<images a block>\[_bb<bands a block>\]"):
            ops.lut_conv2d(a7, w, lut, *args, bad)
    with pytest.raises(RuntimeError, match="no configuration depthwise_planes_b2_i32 for this shape"):
        ops.lut_conv2d(a7, w, lut, *args, "depthwise_planes_b2_i32")  # 14x14 at stride 2's
    a14 = make_codes(gen, (40, 4, 14, 14), True).to(DEV)
    ops.lut_conv2d(a14, w, lut, [2, 2], [1, 1], [1, 1], 4, "auto")
    pick = _reported_pick(a14, w, lut, 2, 1, 1, 4)
    want = ops.lut_conv2d(a14, w, lut, [2, 2], [1, 1], [1, 1], 4, "direct")
    check_equal(ops.lut_conv2d(a14, w, lut, [2, 2], [1, 1], [1, 1], 4, pick).cpu(), want.cpu(), f"auto's pick {pick}")


@pytest.mark.parametrize("algo", ["direct", "depthwise_planes"])
def test_depthwise_planes_tables_are_prepared_and_counted(algo):
    """Its channels' tables are prepared with the weights, for every variant's call on the shapes it takes (4.5 KiB
    a channel), and approx::lut_algos' workspace_bytes counts them: the memory a first call keeps allocated."""
    gen = torch.Generator().manual_seed(62)
    a = make_codes(gen, (8, 200, 7, 7), True).to(DEV)
    w, lut = make_weights(gen, (200, 1, 3, 3), True).to(DEV), make_lut(gen, "int16").to(DEV)
    args = ([1, 1], [1, 1], [1, 1], 200)
    want = {r["algo"]: r["workspace_bytes"] for r in algo_table(a, w, lut, *args, backend="cuda")}[algo]
    a14 = make_codes(gen, (8, 200, 14, 14), True).to(DEV)  # stride 1 at 14x14: no such tables
    direct14 = {r["algo"]: r["workspace_bytes"] for r in algo_table(a14, w, lut, *args, backend="cuda")}["direct"]
    assert want - direct14 == 200 * 4608
    if NO_CACHING:
        pytest.skip("caching allocator off (compute-sanitizer runs): memory_allocated does not count as it does")
    w_other = w.clone()
    kept, _ = kept_by_first_call(lambda: ops.lut_conv2d(a, w, lut, *args, algo),
                                 lambda: ops.lut_conv2d(a, w_other, lut, *args, algo))
    assert kept == alloc_blocks(want), (algo, kept, want)
