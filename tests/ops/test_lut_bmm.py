"""approx::lut_bmm (both operands dynamic) and the float-level approx::qmatmul built on it: the reference
against per-batch lut_linear, every compiled backend against the reference bit for bit, opcheck, fakes, and
qmatmul's forward and both gradients against independent element-wise definitions."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from runner import ops, ops_autograd, reference
from runner.errors import UserError
from runner.multipliers.core import exact_lut

from .conftest import backend_params, codes, random_lut, weights

# a shape per kind of edge: one row / column / tap, tiles not filled, long K, many small batches
SHAPES = [(1, 1, 1, 1), (3, 5, 4, 7), (2, 17, 9, 33), (1, 3, 2, 300), (40, 3, 5, 8), (2, 5, 72, 16),
          (2, 197, 13, 64)]


def bmm_backends():
    have = hasattr(torch.ops.approx, "lut_bmm")
    return [pytest.param(b, d, id=b, marks=p.marks + [pytest.mark.skipif(not have, reason="runner._C predates "
                                                                                           "lut_bmm")])
            for p in backend_params() for b, d in [p.values]]


def _operands(gen, shape, signed, lut_lo=-(2**15), lut_hi=2**15):
    nb, m, n, k = shape
    return codes(gen, (nb, m, k), signed), weights(gen, (nb, n, k)), random_lut(gen, lut_lo, lut_hi)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("shape", SHAPES[:5])
def test_reference_is_lut_linear_per_batch(gen, shape, signed):
    a, b, lut = _operands(gen, shape, signed)
    out = reference.reference_lut_bmm(a, b, lut)
    want = torch.stack([reference.reference_lut_linear(a[i], b[i], lut) for i in range(shape[0])])
    assert out.dtype == torch.int32 and torch.equal(out, want)


def test_reference_wraps_like_an_int32_accumulator(gen):
    a, b, _ = _operands(gen, (2, 3, 4, 64), True)
    lut = torch.full((256, 256), 2**31 - 1, dtype=torch.int32)
    want = ((64 * (2**31 - 1) + 2**31) % 2**32) - 2**31
    assert (reference.reference_lut_bmm(a, b, lut) == want).all()


def _table(gen, kind):
    """Tables of each range the CUDA kernel treats apart: products within int16 (shared-memory int16 table),
    within [0, 65535] (unsigned multipliers' magnitudes, as mul8u's up to 65025), and beyond (int32 through
    L1/L2)."""
    lo, hi = {"int16": (-(2**14), 2**14), "uint16": (0, 2**16), "int32": (-(2**31), 2**31 - 1)}[kind]
    return random_lut(gen, lo, hi)


TABLES = ["int16", "uint16", "int32"]


@pytest.mark.parametrize("backend,device", bmm_backends())
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_equals_reference(gen, backend, device, shape, signed, table):
    a, b, _ = _operands(gen, shape, signed)
    lut = _table(gen, table)
    want = reference.reference_lut_bmm(a, b, lut)
    if device == "cuda":  # the output's memory held garbage before: every element must be written
        torch.full((sum(shape) * 4096,), -7, dtype=torch.int32, device=device)
    out = ops.lut_bmm(a.to(device), b.to(device), lut.to(device), backend=backend)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("backend,device", bmm_backends())
@pytest.mark.parametrize("table", TABLES)
def test_compiled_wraps_and_takes_large_k(gen, backend, device, table):
    a, b, _ = _operands(gen, (2, 5, 6, 2048), table == "uint16")
    lut = _table(gen, table)
    out = ops.lut_bmm(a.to(device), b.to(device), lut.to(device), backend=backend)
    assert torch.equal(out.cpu(), reference.reference_lut_bmm(a, b, lut))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch.ops.approx, "lut_bmm"), reason="no CUDA")
@pytest.mark.parametrize("shape", [(3, 197, 197, 64), (3, 197, 64, 197), (2, 65, 65, 16), (1, 300, 257, 40)])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_cuda_equals_cpp_on_attention_shapes(gen, shape, signed):
    """The shapes the CUDA kernel tiles differently (197 tokens, head dims, more rows than one tile holds),
    against the CPU kernel: faster than the reference at these sizes."""
    a, b, _ = _operands(gen, shape, signed)
    for kind in TABLES:
        lut = _table(gen, kind)
        want = ops.lut_bmm(a, b, lut, backend="cpp")
        assert torch.equal(ops.lut_bmm(a.cuda(), b.cuda(), lut.cuda(), backend="cuda").cpu(), want), kind


@pytest.mark.parametrize("backend,device", bmm_backends())
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_opcheck_lut_bmm(gen, backend, device, signed):
    a, b, lut = _operands(gen, (3, 5, 4, 9), signed)
    torch.library.opcheck(torch.ops.approx.lut_bmm.default, (a.to(device), b.to(device), lut.to(device)))


@pytest.mark.parametrize("backend,device", bmm_backends())
def test_compiled_rejects_bad_input_like_the_reference(gen, backend, device):
    a, b, lut = _operands(gen, (2, 3, 4, 5), True)
    for args in ((a, b[:1], lut), (a, b[..., :4].contiguous(), lut), (a, b.to(torch.uint8), lut),
                 (a[0], b[0], lut), (a, b, lut[:128].contiguous()), (a.transpose(1, 2), b, lut)):
        args = [t.to(device) for t in args]
        with pytest.raises(RuntimeError, match="lut_bmm") as ref_err:
            reference.reference_lut_bmm(*args)
        with pytest.raises(RuntimeError, match="lut_bmm") as err:
            ops.lut_bmm(*args, backend=backend)
        assert str(ref_err.value).split(":")[1].split()[:2] == str(err.value).split("lut_bmm:")[1].split()[:2]


def _variants_or_skip():
    names = ops.lut_bmm_variants()
    if not names or not hasattr(torch.ops.approx, "lut_bmm_variant"):
        pytest.skip("runner._C predates lut_bmm_variant")
    return names


def test_variant_selector_validates_names_and_indices(gen):
    """approx::lut_bmm_variant (the CUDA kernel's layouts, for benchmarks): the list starts with what lut_bmm runs,
    names and indices select, and an unknown one is an error naming the valid ones, on the CPU as on CUDA (one
    check in checks.h); every valid variant on the CPU is the one CPU kernel."""
    names = _variants_or_skip()
    assert names[0] == "g2_r4c8_k64_pad" and len(set(names)) == len(names) > 1
    a, b, lut = _operands(gen, (2, 5, 3, 9), True)
    want = reference.reference_lut_bmm(a, b, lut)
    for v in (0, len(names) - 1, names[1]):
        assert torch.equal(ops.lut_bmm_variant(a, b, lut, v, backend="cpp"), want)
    for bad in (-1, len(names)):
        with pytest.raises(RuntimeError, match=rf"lut_bmm: unknown variant {bad}; variants: 0 {names[0]}, 1 {names[1]}"):
            ops.lut_bmm_variant(a, b, lut, bad, backend="cpp")
    with pytest.raises(UserError, match="unknown lut_bmm variant 'nope'; valid: " + ", ".join(names)):
        ops.lut_bmm_variant(a, b, lut, "nope", backend="cpp")
    with pytest.raises(UserError, match="name or an int"):
        ops.lut_bmm_variant(a, b, lut, 1.0, backend="cpp")
    with pytest.raises(UserError, match="compiled kernel"):
        ops.lut_bmm_variant(a, b, lut, 0, backend="python")
    with pytest.raises(RuntimeError, match="lut_bmm: codes `b` must be int8"):  # the op's input checks still run
        ops.lut_bmm_variant(a, b.to(torch.uint8), lut, 0, backend="cpp")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch.ops.approx, "lut_bmm"), reason="no CUDA")
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 17, 9, 33), (3, 197, 197, 64), (2, 197, 64, 197),
                                   (1, 300, 257, 40), (1, 3, 2, 300)])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_cuda_variants_equal_reference(gen, shape, signed):
    """Every layout of the CUDA kernel, each table range (S16, U16, G32 modes), against the reference."""
    names = _variants_or_skip()
    a, b, _ = _operands(gen, shape, signed)
    for kind in TABLES:
        lut = _table(gen, kind)
        want = ops.lut_bmm(a, b, lut, backend="cpp")
        for v in names:
            out = ops.lut_bmm_variant(a.cuda(), b.cuda(), lut.cuda(), v, backend="cuda").cpu()
            assert torch.equal(out, want), (kind, v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch.ops.approx, "lut_bmm"), reason="no CUDA")
def test_cuda_lut_bmm_times_its_pick_outside_graph_capture_only(gen):
    """lut_bmm on CUDA times its candidate layouts on a shape's first call and keeps the pick; a shape first seen
    inside a CUDA graph capture runs variant 0 untimed (a timing would synchronise the capturing stream)."""
    a, b, lut = _operands(gen, (1, 29, 31, 44), True)
    want = ops.lut_bmm(a, b, lut, backend="cpp")
    ad, bd, ld = a.cuda(), b.cuda(), lut.cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.lut_bmm(ad, bd, ld, backend="cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
    a, b, _ = _operands(gen, (2, 45, 37, 68), True)
    want = ops.lut_bmm(a, b, lut, backend="cpp")
    for _ in range(2):  # the timed first call, then the kept pick
        assert torch.equal(ops.lut_bmm(a.cuda(), b.cuda(), ld, backend="cuda").cpu(), want)


def test_fakes_give_the_output_shapes():
    with FakeTensorMode():
        x, y = torch.empty(2, 3, 7, 5), torch.empty(2, 3, 4, 5)
        s, lut = torch.empty(()), torch.empty(256, 256, dtype=torch.int32)
        out = torch.ops.approx.qmatmul(x, y, s, s, lut, torch.empty(0), torch.empty(0), True, True, True,
                                       "python", "ste")
        assert out.shape == (2, 3, 7, 4) and out.dtype == torch.float32
        if hasattr(torch.ops.approx, "lut_bmm"):
            acc = torch.ops.approx.lut_bmm(torch.empty(6, 7, 5, dtype=torch.int8),
                                           torch.empty(6, 4, 5, dtype=torch.int8), lut)
            assert acc.shape == (6, 7, 4) and acc.dtype == torch.int32


# ---------------------------------------------------------------------------------------------------------------
# qmatmul

def _floats(gen, shape_x, shape_y, x_signed, y_signed, lut_signed):
    x, y = torch.randn(shape_x, generator=gen), torch.randn(shape_y, generator=gen)
    x, y = (x if x_signed else x.abs()), (y if y_signed else y.abs())
    xr, yr = ops_autograd.matmul_qranges(lut_signed, x_signed, y_signed)
    # scales that clip the largest values, so the clipping masks matter
    sx = ops_autograd.matmul_scale(x.abs().max() * 0.8, xr[1])
    sy = ops_autograd.matmul_scale(y.abs().max() * 0.8, yr[1])
    return x, y, sx, sy


def _codes(t, s, qrange):
    return torch.clamp(torch.round(t / s), *qrange).to(torch.int64)


KINDS = [(True, True, True), (True, False, True), (False, True, True), (False, False, True), (False, True, False)]
KIND_IDS = ["s-table,x,y", "s-table,P,V", "u-table,x,y", "u-table,P,V", "u-table,x,P"]


@pytest.mark.parametrize("lut_signed,x_signed,y_signed", KINDS, ids=KIND_IDS)
def test_qmatmul_is_its_definition(gen, lut_signed, x_signed, y_signed):
    """Forward, element by element: signed tables index [a + 128][b + 128]; unsigned ones multiply magnitudes
    and apply the signs after (sign(0) = 0 on the sign-magnitude side), an unsigned x reading row a."""
    lut = random_lut(gen, -(2**12), 2**12)
    x, y, sx, sy = _floats(gen, (2, 3, 4), (2, 5, 4), x_signed, y_signed, lut_signed)
    xr, yr = ops_autograd.matmul_qranges(lut_signed, x_signed, y_signed)
    a, b = _codes(x, sx, xr), _codes(y, sy, yr)
    if lut_signed:
        prod = lut[a.unsqueeze(2) + 128, b.unsqueeze(1) + 128].to(torch.int64)
    elif x_signed:
        prod = lut[a.abs().unsqueeze(2), b.abs().unsqueeze(1)] * torch.sign(a).unsqueeze(2) * torch.sign(b).unsqueeze(1)
    else:
        prod = lut[a.unsqueeze(2), b.abs().unsqueeze(1)] * torch.sign(b).unsqueeze(1)
    want = prod.sum(-1).to(torch.float32) * (sx * sy)
    out = ops_autograd.qmatmul(x, y, sx, sy, lut, x_signed, y_signed, "python", lut_signed=lut_signed)
    assert torch.equal(out, want)


@pytest.mark.parametrize("lut_signed,x_signed,y_signed", KINDS, ids=KIND_IDS)
def test_qmatmul_exact_table_is_fake_quant(gen, lut_signed, x_signed, y_signed):
    """Values and the STE gradient equal fake-quant's (torch's fake-quantize at each operand's range, an exact
    float matmul of the codes, the same dequantization)."""
    x, y, sx, sy = _floats(gen, (2, 3, 6, 8), (2, 3, 5, 8), x_signed, y_signed, lut_signed)
    xr, yr = ops_autograd.matmul_qranges(lut_signed, x_signed, y_signed)
    x1, y1 = x.clone().requires_grad_(), y.clone().requires_grad_()
    out = ops_autograd.qmatmul(x1, y1, sx, sy, exact_lut(lut_signed), x_signed, y_signed, "python",
                               lut_signed=lut_signed)
    x2, y2 = x.clone().requires_grad_(), y.clone().requires_grad_()
    zero = torch.zeros((), dtype=torch.int32)
    xq = torch.fake_quantize_per_tensor_affine(x2, sx, zero, *xr)
    yq = torch.fake_quantize_per_tensor_affine(y2, sy, zero, *yr)
    acc = torch.matmul(torch.round(xq / sx), torch.round(yq / sy).transpose(-1, -2))  # exact integers
    assert torch.equal(out, acc * (sx * sy))
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    torch.matmul(xq, yq.transpose(-1, -2)).backward(g)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(y1.grad, y2.grad)


@pytest.mark.parametrize("lut_signed,x_signed,y_signed", KINDS[:4], ids=KIND_IDS[:4])
def test_qmatmul_lut_gradient_is_the_chain_rule_through_the_slopes(gen, lut_signed, x_signed, y_signed):
    lut = random_lut(gen, -(2**12), 2**12)
    x, y, sx, sy = _floats(gen, (2, 3, 4), (2, 2, 4), x_signed, y_signed, lut_signed)
    x.requires_grad_(), y.requires_grad_()
    sl_x, sl_y = ops_autograd.matmul_slope_tables(lut, lut_signed, x_signed, 2)
    out = ops_autograd.qmatmul(x, y, sx, sy, lut, x_signed, y_signed, "python", "lut", sl_x, sl_y,
                               lut_signed=lut_signed)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    xr, yr = ops_autograd.matmul_qranges(lut_signed, x_signed, y_signed)
    a, b = _codes(x.detach(), sx, xr), _codes(y.detach(), sy, yr)
    row = a + 128 if (lut_signed or x_signed) else a     # int8 codes index row a + 128
    qx, qy = torch.round(x.detach() / sx), torch.round(y.detach() / sy)
    in_x, in_y = (qx >= xr[0]) & (qx <= xr[1]), (qy >= yr[0]) & (qy <= yr[1])
    gx, gy = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(y.shape, dtype=torch.float64)
    for i in range(2):
        for m in range(3):
            for n in range(2):
                for k in range(4):
                    r, c = row[i, m, k], b[i, n, k] + 128
                    gx[i, m, k] += g[i, m, n] * sy * sl_x[r, c]
                    gy[i, n, k] += g[i, m, n] * sx * sl_y[r, c]
    torch.testing.assert_close(x.grad, (gx * in_x).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.grad, (gy * in_y).float(), rtol=1e-5, atol=1e-6)


def test_sign_magnitude_slopes_follow_the_magnitude_table():
    """For the exact unsigned table used sign-magnitude, the slopes are the other operand (inside the range), so
    grad="lut" equals grad="ste" there."""
    sl_x, sl_y = ops_autograd.matmul_slope_tables(exact_lut(False), False, True)
    v = torch.arange(-127, 128).to(torch.float32)
    torch.testing.assert_close(sl_x[1:, 1:], v.unsqueeze(0).expand(255, 255))
    torch.testing.assert_close(sl_y[1:, 1:], v.unsqueeze(1).expand(255, 255))


def qmatmul_opcheck_cases():
    """opcheck is slow (it traces under aot_autograd), so each backend gets one gradient and kind of operands,
    the python one and the compiled ones covering both gradients and both table kinds between them."""
    cases = [pytest.param("python", "cpu", "lut", *KINDS[2], id="python-lut-" + KIND_IDS[2])]
    for p in bmm_backends():
        cases.append(pytest.param(*p.values, "ste", *KINDS[1], id=f"{p.id}-ste-{KIND_IDS[1]}", marks=p.marks))
    return cases


@pytest.mark.parametrize("backend,device,grad,lut_signed,x_signed,y_signed", qmatmul_opcheck_cases())
def test_opcheck_qmatmul(gen, backend, device, grad, lut_signed, x_signed, y_signed):
    lut = random_lut(gen, -(2**12), 2**12)
    x, y, sx, sy = _floats(gen, (2, 5, 6), (2, 3, 6), x_signed, y_signed, lut_signed)
    sl = ops_autograd.matmul_slope_tables(lut, lut_signed, x_signed, 2)
    args = [t.to(device) for t in (x, y, sx, sy, lut, *sl)]
    for t in args[:4]:
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.approx.qmatmul.default, (*args, lut_signed, x_signed, y_signed, backend, grad))


@pytest.mark.parametrize("backend,device", bmm_backends())
@pytest.mark.parametrize("lut_signed,x_signed,y_signed", KINDS, ids=KIND_IDS)
def test_qmatmul_backends_agree_bit_for_bit(gen, backend, device, lut_signed, x_signed, y_signed):
    lut = random_lut(gen, -(2**12), 2**12)
    x, y, sx, sy = _floats(gen, (3, 7, 10), (3, 6, 10), x_signed, y_signed, lut_signed)
    sl = ops_autograd.matmul_slope_tables(lut, lut_signed, x_signed)
    res = []
    for be, dev in (("python", "cpu"), (backend, device)):
        # fresh leaves each pass: x.to('cpu') is x itself, whose .grad would accumulate over both passes and
        # be one tensor in both results
        xx, yy = x.detach().clone().to(dev).requires_grad_(), y.detach().clone().to(dev).requires_grad_()
        out = ops_autograd.qmatmul(xx, yy, sx.to(dev), sy.to(dev), lut.to(dev), x_signed, y_signed, be, "lut",
                                   *[s.to(dev) for s in sl], lut_signed=lut_signed)
        out.backward(torch.ones_like(out))
        res.append([t.cpu() for t in (out, xx.grad, yy.grad)])
    assert torch.equal(res[0][0], res[1][0])
    for r0, r1 in zip(res[0][1:], res[1][1:]):
        torch.testing.assert_close(r0, r1, rtol=1e-5, atol=1e-5)


def test_qmatmul_rejects_broadcasting_and_lut_grad_without_slopes():
    x, y, s, lut = torch.randn(2, 3, 4), torch.randn(1, 5, 4), torch.tensor(0.1), exact_lut(True)
    with pytest.raises(RuntimeError, match="same leading dims"):
        ops_autograd.qmatmul(x, y, s, s, lut, True, True, "python", lut_signed=True)
    with pytest.raises(RuntimeError, match="slope"):
        ops_autograd.qmatmul(x, x, s, s, lut, True, True, "python", "lut", lut_signed=True)
