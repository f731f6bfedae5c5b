"""approx::lut_conv2d_dequantize / lut_conv2d_requantize_codes: a conv and its end in one op give what
lut_conv2d followed by dequantize (with a residual, ReLU and the next layer's codes) or requantize_codes gives, bit
for bit, on every backend; on CUDA expanded_window, an unsplit expanded_gemm, depthwise_rows and depthwise_planes
(int16 products) apply the end in their own stores (named, and auto's cached pick), every other variant runs the two
ops."""
import pytest
import torch

from runner import ops
from runner.quant import requant_multiplier

from .conftest import backend_params, codes, random_lut, taps_of, weights

CONVS = [
    # (B, C, H, W), (N, kh, kw), stride, padding
    ((2, 16, 12, 12), (24, 3, 3), 1, 1),   # whole aligned runs of 8 outputs: the 16-byte stores
    ((3, 8, 14, 14), (13, 3, 3), 1, 1),    # 14-wide rows (7 outputs a thread), N not a multiple of 8
    ((2, 6, 10, 9), (16, 3, 3), 2, 1),     # stride 2, odd width: the scalar stores
    ((2, 12, 8, 8), (20, 1, 1), 1, 0),     # 1x1: 4 channels a table chunk
    ((1, 5, 11, 11), (9, 5, 5), 1, 2),     # 5x5
    ((2, 8, 16, 16), (12, 3, 3), 1, 1, 2),  # 2 groups: each group's channels at their place in the output
    # 1x1 convs without padding, which CUDA's auto runs in its own layout (>= 2048 output rows): strided, as the
    # stride-1 conv of the sampled codes (16x17 planes: its end in the stores); 7x7 planes, the batch folded into
    # one image (the two ops)
    ((8, 12, 32, 34), (20, 1, 1), 2, 0),
    ((44, 8, 7, 7), (12, 1, 1), 1, 0),
    # 3x3 convs, which it runs as a 1x1 conv over their taps (im2col): strided to 16x16 planes (the end in the
    # stores), 7x7 ones folded (the two ops)
    ((10, 8, 32, 32), (20, 3, 3), 2, 1),
    ((44, 4, 7, 7), (12, 3, 3), 1, 1),
    # a 3x3 conv of stride 1 on 16x16 planes, 2560 rows: auto times its taps against the shape as given on the first
    # call (the composite), and a later call applies the end in the way that was faster
    ((10, 8, 16, 16), (20, 3, 3), 1, 1),
    # depthwise 3x3 convs (depthwise_rows): 7 outputs a thread on 14-wide rows (their runs start anywhere: 8- and
    # 2-byte stores at either alignment), 8 on 16-wide rows (16-byte / 8-byte stores), part runs on 9-wide rows,
    # stride 2 to 7x7 planes; rows of whole words (28 wide) at stride 2, loaded a word at a time (depthwise_planes
    # too: bands of two output rows, the middle ones on shifted rows)
    ((3, 16, 14, 14), (16, 3, 3), 1, 1, 16),
    ((2, 8, 16, 16), (8, 3, 3), 1, 1, 8),
    ((2, 12, 9, 9), (12, 3, 3), 1, 1, 12),
    ((3, 20, 14, 14), (20, 3, 3), 2, 1, 20),
    ((2, 8, 28, 28), (8, 3, 3), 2, 1, 8),
    # 7x7 planes at stride 1 (depthwise_planes too: a value a store, planes 0-3 bytes into a word), 33 images: a
    # warp of 32 and one of 1
    ((33, 12, 7, 7), (12, 3, 3), 1, 1, 12),
]


def _same(got, want):
    """Equal bit for bit (-0.0 is not 0.0), NaN where NaN."""
    got = got.cpu()
    if got.dtype != torch.float32:
        return got.dtype == want.dtype and torch.equal(got, want)
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(got.masked_fill(nan, 0).view(torch.int32),
                                                              want.masked_fill(nan, 0).view(torch.int32))


def _end_args(gen, shape, n):
    sa = torch.tensor(0.0123)
    sw, bias = torch.rand(n, generator=gen) * 0.01 + 1e-4, torch.randn(n, generator=gen) * 20
    residual = torch.randn(shape, generator=gen) * 300
    residual.view(-1)[:2] = torch.tensor([float("nan"), -0.0])
    return sa, sw, bias, residual


def _requant(gen, n):
    m0, shift = requant_multiplier(torch.rand(n, dtype=torch.float64, generator=gen) * 1e-3 + 1e-5)
    return torch.randint(-5000, 5000, (n,), generator=gen, dtype=torch.int32), m0, shift


def _algos(backend, groups=1, stride=None, hw=None):
    # CUDA: expanded_window named (8 outputs a thread; 7 where a 3- or 5-wide kernel's rows allow it; 2 channels
    # staged at a time, so the planes are restaged between table chunks); expanded_gemm's tiles (convs of one
    # group): 128 R rows x 32 channels, r8c's copied build (its cp.async codes at the 1x1 case), the tall tiles of
    # 16 and 13 rows a thread (the end in their stores too, int16 products), and a K split, where the two ops run;
    # auto (its first call times and falls back, the second runs its cached pick), and direct (never applies the
    # end itself). Depthwise convs (stride given): depthwise_rows' table layouts and a grid of 2 blocks a channel,
    # and depthwise_planes on the planes it takes
    if backend != "cuda":
        return ("auto",)
    if stride is not None:  # depthwise
        split = ("depthwise_rows_split", "depthwise_rows_split_g2") if stride == 2 else ()
        planes = ("depthwise_planes",) if (stride, hw) in ((1, 7), (2, 14), (2, 28)) else ()
        return ("depthwise_rows", "depthwise_rows_banked", "depthwise_rows_banked8", "depthwise_rows_g2", *split,
                *planes, "auto", "auto", "direct")
    gemm = ("expanded_gemm_r2", "expanded_gemm_r8c", "expanded_gemm_r16c", "expanded_gemm_r13c",
            "expanded_gemm_r8c_k2") if groups == 1 else ()
    return ("expanded_window", "expanded_window_x7", "expanded_window_c2", *gemm, "auto", "auto", "direct")


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
@pytest.mark.parametrize("case", range(len(CONVS)))
@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("products", [3000, 2**20], ids=["int16", "int32"])  # the kernels' two table formats
def test_fused_ends_equal_the_conv_and_its_end(gen, backend, device, case, signed, products):
    (b, c, h, w_), (n, kh, kw), stride, pad, *grouped = CONVS[case]
    groups = grouped[0] if grouped else 1
    a, w = codes(gen, (b, c, h, w_), signed), weights(gen, (n, c // groups, kh, kw))
    if not signed:
        w[w == -128] = -127
    lut = random_lut(gen, -products, products)
    conv = (stride, pad, 1, groups)
    acc = ops.lut_conv2d(a, w, lut, *conv, backend="python")
    sa, sw, bias, residual = _end_args(gen, acc.shape, n)
    qbias, m0, shift = _requant(gen, n)
    cs = torch.tensor(0.7)
    want_codes = torch.empty(acc.shape, dtype=torch.int8 if signed else torch.uint8)
    want = {
        "plain": ops.dequantize(acc, sa, sw, bias, backend="python"),
        "relu": ops.dequantize(acc, sa, sw, bias, None, True, backend="python"),
        "block": ops.dequantize(acc, sa, sw, bias, residual, True, want_codes, cs, backend="python"),
        "handoff": ops.requantize_codes(acc, qbias, m0, shift, -128 if signed else 0, 127 if signed else 255, signed,
                                        backend="python"),
    }
    dev = [t.to(device) for t in (a, w, lut, sa, sw, bias, residual, qbias, m0, shift, cs)]
    ad, wd, ld, sad, swd, bd, rd, qbd, md, shd, csd = dev
    for algo in _algos(backend, groups, *((stride, h) if groups == c == n else ())):
        what = f"{CONVS[case]} {backend} {algo}"
        got = ops.lut_conv2d_dequantize(ad, wd, ld, *conv, sad, swd, bd, backend=backend, algo=algo)
        assert _same(got, want["plain"]), what
        got = ops.lut_conv2d_dequantize(ad, wd, ld, *conv, sad, swd, bd, None, True, backend=backend, algo=algo)
        assert _same(got, want["relu"]), what
        got_codes = torch.full(acc.shape, 77, dtype=want_codes.dtype, device=device)
        got = ops.lut_conv2d_dequantize(ad, wd, ld, *conv, sad, swd, bd, rd, True, got_codes, csd, backend=backend,
                                        algo=algo)
        assert _same(got, want["block"]) and _same(got_codes, want_codes), what
        got = ops.lut_conv2d_requantize_codes(ad, wd, ld, *conv, qbd, md, shd, -128 if signed else 0,
                                              127 if signed else 255, signed, backend=backend, algo=algo)
        assert _same(got, want["handoff"]), what


@pytest.mark.parametrize("backend,device", backend_params())
def test_fused_end_with_a_misaligned_residual_and_codes(gen, backend, device):
    """Views one element into their storage: no 16-byte (residual) or 4-byte (codes) alignment, so the stores go
    one value at a time; the values are the same."""
    a, w, lut = codes(gen, (2, 8, 16, 16), True), weights(gen, (16, 8, 3, 3)), random_lut(gen, -3000, 3000)
    acc = ops.lut_conv2d(a, w, lut, 1, 1, backend="python")
    sa, sw, bias, residual = _end_args(gen, acc.shape, 16)
    want_codes = torch.empty(acc.shape, dtype=torch.int8)
    want = ops.dequantize(acc, sa, sw, bias, residual, True, want_codes, torch.tensor(0.5), backend="python")
    res = torch.empty(acc.numel() + 1, device=device)[1:].view(acc.shape).copy_(residual.to(device))
    got_codes = torch.zeros(acc.numel() + 1, dtype=torch.int8, device=device)[1:].view(acc.shape)
    for algo in _algos(backend):
        got = ops.lut_conv2d_dequantize(a.to(device), w.to(device), lut.to(device), 1, 1, 1, 1, sa.to(device),
                                        sw.to(device), bias.to(device), res, True, got_codes,
                                        torch.tensor(0.5, device=device), backend=backend, algo=algo)
        assert _same(got, want) and _same(got_codes, want_codes), algo


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
def test_fused_ends_reject_what_their_end_rejects(gen, backend, device):
    a, w, lut = codes(gen, (1, 4, 6, 6), True), weights(gen, (8, 4, 3, 3)), random_lut(gen)
    t = [x.to(device) for x in (a, w, lut, torch.tensor(0.1), torch.rand(8), torch.randn(8))]
    with pytest.raises((RuntimeError, ValueError), match="residual"):
        ops.lut_conv2d_dequantize(*t[:3], 1, 1, 1, 1, *t[3:], torch.zeros(1, 8, 5, 5, device=device),
                                  backend=backend)
    with pytest.raises((RuntimeError, ValueError), match="qmin"):
        ops.lut_conv2d_requantize_codes(*t[:3], 1, 1, 1, 1, torch.zeros(8, dtype=torch.int32, device=device),
                                        torch.ones(8, dtype=torch.int32, device=device),
                                        torch.ones(8, dtype=torch.int32, device=device), 0, 255, True, backend=backend)


@pytest.mark.parametrize("backend,device", backend_params())
def test_opcheck_fused_ends(gen, backend, device):
    a, w, lut = codes(gen, (2, 8, 9, 9), False), weights(gen, (12, 8, 3, 3)), random_lut(gen, -3000, 3000)
    w[w == -128] = -127
    a, w, lut = a.to(device), w.to(device), lut.to(device)
    sa, sw, bias = torch.tensor(0.02, device=device), torch.rand(12, device=device), torch.randn(12, device=device)
    conv = ([1, 1], [1, 1], [1, 1], 1, "auto")
    torch.library.opcheck(torch.ops.approx.lut_conv2d_dequantize.default, (a, w, lut, *conv, sa, sw, bias))
    torch.library.opcheck(torch.ops.approx.lut_conv2d_dequantize.default,
                          (a, w, lut, *conv, sa, sw, bias, torch.randn(2, 12, 9, 9, device=device), True,
                           torch.zeros(2, 12, 9, 9, dtype=torch.uint8, device=device),
                           torch.tensor(0.3, device=device)))
    qb, m0, shift = (t.to(device) for t in _requant(gen, 12))
    torch.library.opcheck(torch.ops.approx.lut_conv2d_requantize_codes.default,
                          (a, w, lut, *conv, qb, m0, shift, 0, 255, False))


def _cuda_kernels(fn):
    """The names of the CUDA kernels fn() launches (after a warm-up call: table builds, auto's trials), and what the
    profiled call returned."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = fn()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "the profiler saw no kernel"
    return kernels, got


@pytest.mark.cuda
@pytest.mark.parametrize("algo,hw,in_stores", [
    ("expanded_window", 12, True), ("expanded_window", 11, True), ("expanded_gemm_r2", 12, True),
    ("expanded_gemm_r8c", 12, True), ("expanded_gemm_r8c", 11, False),  # 121-output planes: the two ops
    ("expanded_gemm_r16c", 12, True), ("expanded_gemm_r13c", 12, True), ("expanded_gemm_r16c", 11, False),
    ("expanded_gemm_r8c_k2", 12, False), ("direct", 12, False),
    ("expanded_gemm_r8c", "1x1 s2", True), ("auto", "1x1 s2", None), ("auto", "3x3 taps", None)])
def test_which_variants_apply_the_end_in_their_stores(gen, algo, hw, in_stores):
    """The values cannot tell the end in a kernel's stores from the two ops (they are the same bits): the kernels a
    call launches can. Where the variant applies the end, no quant kernel runs. "1x1 s2" and "3x3 taps": a strided
    1x1 conv and a strided 3x3 conv of 2304 output rows, which auto runs as a stride-1 1x1 conv over their taps
    (12x12 planes), with the end in the stores where its pick for that layout applies it (None: read from the
    pick)."""
    b, size, k, stride, pad = {"1x1 s2": (16, 24, 1, 2, 0), "3x3 taps": (16, 24, 3, 2, 1)}.get(hw, (2, hw, 3, 1, 1))
    out_hw = 12 if isinstance(hw, str) else hw
    a, w, lut = codes(gen, (b, 16, size, size), False), weights(gen, (24, 16, k, k)), random_lut(gen, -3000, 3000)
    w[w == -128] = -127
    a, w, lut = a.cuda(), w.cuda(), lut.cuda()
    sa, sw, bias = torch.tensor(0.02).cuda(), torch.rand(24).cuda(), torch.randn(24).cuda()
    residual, cs = torch.randn(b, 24, out_hw, out_hw).cuda(), torch.tensor(0.3).cuda()
    out_codes = torch.empty(b, 24, out_hw, out_hw, dtype=torch.uint8).cuda()
    qb, m0, shift = (t.cuda() for t in _requant(gen, 24))

    def calls():
        ops.lut_conv2d_dequantize(a, w, lut, stride, pad, 1, 1, sa, sw, bias, residual, True, out_codes, cs,
                                  backend="cuda", algo=algo)
        ops.lut_conv2d_requantize_codes(a, w, lut, stride, pad, 1, 1, qb, m0, shift, 0, 255, False, backend="cuda",
                                        algo=algo)
    kernels, _ = _cuda_kernels(calls)
    if in_stores is None:  # lut_ops.cpp's applies_end for auto's pick in the layout of the taps
        taps = taps_of(a, (k, k), stride, pad, 1)
        pick = next(r["auto_pick_name"] for r in ops.algo_table(taps, w.view(24, -1, 1, 1), lut, backend="cuda")
                    if r["auto_pick"])
        in_stores = pick.startswith("expanded_window") or (pick.startswith("expanded_gemm") and "_k" not in pick)
    quant = [k for k in kernels if "quantize" in k]
    assert (not quant) == in_stores, kernels


@pytest.mark.cuda
@pytest.mark.parametrize("algo,case,in_stores", [
    ("depthwise_rows", "14x14", True), ("depthwise_rows_banked", "14x14", True),
    ("depthwise_rows_banked8", "16x16", True),
    ("depthwise_rows_split", "14x14 s2", True), ("auto", "14x14", None),
    ("depthwise_rows", "off a word", False),  # codes one byte into their storage: rows staged, the two ops
    ("depthwise_rows", "int32", False),       # products past int16: the two ops
    ("depthwise_planes", "14x14 s2", True), ("depthwise_planes", "7x7", True), ("auto", "7x7", None),
    ("depthwise_planes", "off a word s2", False), ("depthwise_planes", "int32 s2", False)])
def test_depthwise_rows_applies_the_end_in_its_stores(gen, algo, case, in_stores):
    """As above, for depthwise convs: no quant kernel where depthwise_rows or depthwise_planes applies the end, and
    the values equal the two ops' either way (None: read from auto's pick)."""
    hw = 16 if case == "16x16" else 7 if case == "7x7" else 14
    stride = 2 if "s2" in case else 1
    shape = (4, 16, hw, hw)
    a = codes(gen, shape, False)
    products = 2**20 if case.startswith("int32") else 3000
    w, lut = weights(gen, (16, 1, 3, 3)), random_lut(gen, -products, products)
    w[w == -128] = -127
    qb, m0, shift = _requant(gen, 16)
    conv = (stride, 1, 1, 16)
    want = ops.requantize_codes(ops.lut_conv2d(a, w, lut, *conv, backend="python"), qb, m0, shift, 0, 255, False,
                                backend="python")
    if case.startswith("off a word"):
        a = torch.empty(a.numel() + 1, dtype=a.dtype, device="cuda")[1:].view(shape).copy_(a)
    a, w, lut, qb, m0, shift = (t.cuda() for t in (a, w, lut, qb, m0, shift))

    def call():
        return ops.lut_conv2d_requantize_codes(a, w, lut, *conv, qb, m0, shift, 0, 255, False, backend="cuda",
                                               algo=algo)
    kernels, got = _cuda_kernels(call)
    if in_stores is None:
        pick = next(r["auto_pick_name"] for r in ops.algo_table(a, w, lut, *conv, backend="cuda") if r["auto_pick"])
        in_stores = pick.startswith(("depthwise_rows", "depthwise_planes", "expanded_window"))  # applies_end
    assert (not [k for k in kernels if "quantize" in k]) == in_stores, kernels
    assert _same(got, want)
