"""approx::quantize / dequantize / requantize / requantize_codes: the fused ends of an approx layer equal their references
(fake-quant's integers; the eager dequantize expression; the integer requantization) bit for bit on every
backend."""
import pytest
import torch

from runner import ops, reference
from runner.errors import UserError
from runner.quant import requant_multiplier

from .conftest import backend_params, needs_compiled


def _tricky_inputs(gen, scale, n=20000):
    """Values on and next to the rounding ties (k + 0.5) * scale, out-of-range values, zeros, signs."""
    k = torch.randint(-300, 300, (n,), generator=gen).float()
    ties = (k + 0.5) * scale
    near = torch.nextafter(ties, torch.full_like(ties, float("inf")))
    return torch.cat([ties, near, torch.nextafter(ties, -torch.full_like(ties, float("inf"))),
                      torch.randn(n, generator=gen) * 200 * scale, torch.zeros(7)])


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_equals_fake_quant_integers(gen, backend, device, signed):
    for scale in (0.0123, 1 / 255, 0.3, 3.7e-5):
        s = torch.tensor(scale, dtype=torch.float32)
        x = _tricky_inputs(gen, float(s))
        expected = reference.reference_quantize(x, s, signed)
        got = ops.quantize(x.to(device), s.to(device), signed, backend=backend).cpu()
        assert got.dtype == expected.dtype and torch.equal(got, expected), scale


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("shape", [(5, 7), (3, 6, 4, 5), (0, 4)])
def test_dequantize_equals_eager_expression(gen, backend, device, shape):
    acc = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)
    sa = torch.rand((), generator=gen) * 0.01
    sw, bias = torch.rand(shape[1], generator=gen), torch.randn(shape[1], generator=gen)
    expected = reference.reference_dequantize(acc, sa, sw, bias)
    got = ops.dequantize(*(t.to(device) for t in (acc, sa, sw, bias)), backend=backend).cpu()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
@pytest.mark.parametrize("shape", [(3, 6, 4, 5), (2, 16, 8, 8), (4, 5, 3, 3), (2, 8, 7, 7), (6, 10), (5, 7)])
def test_dequantize_with_residual_equals_the_blocks_add_and_relu(gen, backend, device, shape):
    """A residual block's end in one pass: relu(dequantize(acc) + residual) as its own forward computes it (eager
    add, in-place ReLU), on the vector (planes of whole 4-element vectors) and scalar kernels; NaN as torch.relu
    leaves it, sums that cancel to +0.0 and come out negative by one rounding."""
    acc = torch.randint(-(2**20), 2**20, shape, generator=gen, dtype=torch.int32)
    acc.view(-1)[:4] = torch.tensor([0, 0, 7, -7], dtype=torch.int32)
    sa = torch.tensor(0.0031)
    sw, bias = torch.rand(shape[1], generator=gen) + 0.01, torch.randn(shape[1], generator=gen) * 50
    bias[0] = -0.0
    plain = reference.reference_dequantize(acc, sa, sw, bias)
    residual = torch.randn(shape, generator=gen) * 3000
    residual.view(-1)[:4] = torch.tensor([-0.0, float("nan"), 0.0, 0.0])
    residual.view(-1)[4:8] = -plain.view(-1)[4:8]  # exact cancellation
    residual.view(-1)[8:12] = torch.nextafter(-plain.view(-1)[8:12], torch.tensor(0.0))  # one rounding from 0
    # the block's own add and ReLU on the same device (a GPU's float add gives its canonical NaN, not the operand's)
    args, res = [t.to(device) for t in (acc, sa, sw, bias)], residual.to(device)
    want_sum = (plain.to(device) + res).cpu()
    want = torch.relu(want_sum.clone())
    got = ops.dequantize(*args, res, True, backend=backend).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # the bits: -0.0 and NaN included
    got_sum = ops.dequantize(*args, res, False, backend=backend).cpu()
    assert torch.equal(got_sum.view(torch.int32), want_sum.view(torch.int32))
    got_relu = ops.dequantize(*args, None, True, backend=backend).cpu()
    assert torch.equal(got_relu.view(torch.int32), torch.relu(plain).view(torch.int32))
    assert (want < plain).any() and (want == 0).any() and (want > 0).any()  # the cases above are all there
    for dtype in (torch.int8, torch.uint8):  # the next layer's codes of the output, written in the same pass
        codes, cs = torch.full(shape, 99, dtype=dtype, device=device), torch.tensor(0.37, device=device)
        got = ops.dequantize(*args, res, True, codes, cs, backend=backend)
        assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
        assert torch.equal(codes.cpu(), reference.reference_quantize(want, cs.cpu(), dtype == torch.int8))
    assert want.view(-1)[1].isnan() and not want.view(-1)[4].signbit()  # NaN kept; a cancelled sum is +0.0


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
def test_dequantize_rejects_a_residual_of_another_shape_or_dtype(backend, device):
    acc = torch.zeros(2, 3, 4, 4, dtype=torch.int32, device=device)
    args = (acc, torch.tensor(0.1, device=device), torch.ones(3, device=device), torch.ones(3, device=device))
    error = ValueError if backend == "python" else RuntimeError
    for bad in (torch.zeros(2, 3, 4, 1, device=device), torch.zeros(2, 3, 4, 4, device=device, dtype=torch.float64)):
        with pytest.raises(error, match="residual"):
            ops.dequantize(*args, bad, True, backend=backend)
    if backend != "python":
        with pytest.raises(RuntimeError, match="contiguous"):
            torch.ops.approx.dequantize(*args, torch.zeros(2, 3, 4, 4, device=device).transpose(2, 3), True)
        scale = torch.tensor(0.1, device=device)
        for codes, match in ((torch.zeros(2, 3, 4, 4, dtype=torch.int32, device=device), "int8 or uint8"),
                             (torch.zeros(2, 3, 4, 1, dtype=torch.int8, device=device), "acc's shape")):
            with pytest.raises(RuntimeError, match=match):
                torch.ops.approx.dequantize(*args, None, False, codes, scale)
        with pytest.raises(RuntimeError, match="come together"):
            torch.ops.approx.dequantize(*args, None, False, torch.zeros(2, 3, 4, 4, dtype=torch.int8, device=device))


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_quantize_flags_non_finite_input(gen, backend, device, bad):
    """The flag is set exactly when some element is NaN or Inf (anywhere in a large input: every block of
    the GPU grid and every CPU chunk may be the one that sees it) and is never cleared; the codes of the
    finite elements are unchanged."""
    x = torch.randn(3 * 2**20 + 7, generator=gen)
    where = int(torch.randint(0, x.numel(), (1,), generator=gen))
    if bad is not None:
        x[where] = bad
    s = torch.tensor(0.02)
    flag = torch.zeros(1, dtype=torch.bool, device=device)
    got = ops.quantize(x.to(device), s.to(device), True, backend=backend, nonfinite=flag).cpu()
    assert bool(flag) == (bad is not None)
    keep = torch.arange(x.numel()) != where
    assert torch.equal(got[keep], reference.reference_quantize(x, s, True)[keep])
    ops.quantize(torch.zeros(5, device=device), s.to(device), True, backend=backend, nonfinite=flag)
    assert bool(flag) == (bad is not None)  # a clean input leaves a raised flag raised


@pytest.mark.parametrize("backend,device", backend_params())
def test_opcheck_quant_ops(gen, backend, device):
    x = (torch.randn(4, 3, 5, 5, generator=gen) * 2).to(device)
    s = torch.tensor(0.05, device=device)
    torch.library.opcheck(torch.ops.approx.quantize.default, (x, s, True))
    torch.library.opcheck(torch.ops.approx.quantize.default, (x.abs(), s, False))
    x[0, 1, 2, 3] = float("nan")
    torch.library.opcheck(torch.ops.approx.quantize.default,
                          (x, s, True, torch.zeros(1, dtype=torch.bool, device=device)))
    acc = torch.randint(-1000, 1000, (4, 3, 5, 5), generator=gen, dtype=torch.int32).to(device)
    torch.library.opcheck(torch.ops.approx.dequantize.default,
                          (acc, s, torch.rand(3, device=device), torch.randn(3, device=device)))
    torch.library.opcheck(torch.ops.approx.dequantize.default,
                          (acc, s, torch.rand(3, device=device), torch.randn(3, device=device),
                           torch.randn(4, 3, 5, 5, device=device), True))
    torch.library.opcheck(torch.ops.approx.dequantize.default,
                          (acc, s, torch.rand(3, device=device), torch.randn(3, device=device),
                           torch.randn(4, 3, 5, 5, device=device), True,
                           torch.zeros(4, 3, 5, 5, dtype=torch.uint8, device=device), torch.tensor(0.02, device=device)))


@pytest.mark.parametrize("backend,device", backend_params())
def test_quant_ops_reject_bad_inputs(backend, device):
    x, s = torch.randn(4, 3, device=device), torch.tensor(0.1, device=device)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.approx.quantize(x.double(), s, True)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.approx.quantize(x.t(), s, True)
    with pytest.raises(RuntimeError, match="1 element"):
        torch.ops.approx.quantize(x, torch.ones(2, device=device), True)
    with pytest.raises(RuntimeError, match="nonfinite"):
        torch.ops.approx.quantize(x, s, True, torch.zeros(2, dtype=torch.bool, device=device))
    acc = torch.zeros(4, 3, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.approx.dequantize(acc.float(), s, torch.ones(3, device=device), torch.ones(3, device=device))
    with pytest.raises(RuntimeError, match="3 element"):
        torch.ops.approx.dequantize(acc, s, torch.ones(2, device=device), torch.ones(3, device=device))


# ---- requantize (quant.requant=integer) ----------------------------------------------------------------------

def _check_codes(got, args, qmin, qmax, backend, device):
    """requantize_codes on the same arguments gives requantize's codes: got == fl(code * out_scale), as int8 codes
    for a signed range (and for a signed consumer behind a ReLU, qmin 0), uint8 for an unsigned one."""
    acc, bias, m0, shift, out_scale = args
    for signed in ((True, False) if qmin == 0 and qmax <= 127 else (qmin < 0,)):
        codes = ops.requantize_codes(*(t.to(device) for t in (acc, bias, m0, shift)), qmin, qmax, signed,
                                     backend=backend).cpu()
        assert codes.dtype == (torch.int8 if signed else torch.uint8) and codes.shape == acc.shape
        assert torch.equal(codes.float() * out_scale, got)


def _exact_requant(v: int, m0: int, shift: int, qmin: int, qmax: int) -> int:
    """The definition in Python's unbounded integers: clamp(floor(v * m0 / 2^shift + 1/2))."""
    return min(max((2 * v * m0 + (1 << shift)) >> (shift + 1), qmin), qmax)


def _requant_args(gen, n, extremes=False):
    real = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-40, 20, generator=gen))
    m0, shift = requant_multiplier(real)
    bias = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
    if extremes:  # the ends of every range: the int64 product and the shifts must neither overflow nor wrap
        m0[:4] = torch.tensor([2**31 - 1, 2**30, 0, 2**31 - 1], dtype=torch.int32)
        shift[:4] = torch.tensor([63, 1, 31, 1], dtype=torch.int32)
        bias[:4] = torch.tensor([2**31 - 1, -(2**31), 0, -(2**31)], dtype=torch.int32)
    return bias, m0, shift


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
@pytest.mark.parametrize("qrange", [(-128, 127), (0, 255)], ids=["signed", "unsigned"])
def test_requantize_equals_unbounded_integer_definition(gen, backend, device, qrange):
    """Every element against the definition in exact integers, at the extremes of acc, bias, M0 and shift:
    (acc + bias) * M0 needs 64 bits and must not wrap; the rounding shift must not overflow."""
    n = 8
    bias, m0, shift = _requant_args(gen, n, extremes=True)
    acc = torch.randint(-(2**31), 2**31 - 1, (64, n), generator=gen, dtype=torch.int32)
    acc[0], acc[1] = 2**31 - 1, -(2**31)
    out_scale = torch.tensor(0.0371)
    got = ops.requantize(*(t.to(device) for t in (acc, bias, m0, shift, out_scale)), *qrange, backend=backend).cpu()
    want = torch.tensor([[_exact_requant(int(acc[i, c]) + int(bias[c]), int(m0[c]), int(shift[c]), *qrange)
                          for c in range(n)] for i in range(acc.shape[0])], dtype=torch.float32) * out_scale
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("shape", [(5, 7), (3, 6, 4, 5), (0, 4)])
def test_requantize_kernels_equal_reference(gen, backend, device, shape):
    bias, m0, shift = _requant_args(gen, shape[1])
    bias //= 4096  # biases of the size quantize_bias gives, so codes land inside the range too, not only clamped
    acc = torch.randint(-(2**20), 2**20, shape, generator=gen, dtype=torch.int32)
    m0, shift = requant_multiplier(torch.rand(shape[1], generator=gen, dtype=torch.float64) * 1e-4)
    for qrange in ((-128, 127), (0, 255)):
        args = (acc, bias, m0, shift, torch.tensor(0.0123))
        expected = reference.reference_requantize(*args, *qrange)
        got = ops.requantize(*(t.to(device) for t in args), *qrange, backend=backend).cpu()
        assert torch.equal(got, expected)
        if acc.numel() > 300:
            assert expected.unique().numel() > 30  # values inside the range: rounding, not only clamping


def test_requant_multiplier_is_the_real_multiplier_to_31_bits(gen):
    real = torch.cat([torch.exp(torch.empty(1000, dtype=torch.float64).uniform_(-21, 20, generator=gen)),
                      torch.tensor([1.0, 0.5, 2.0**-21, 2.0**29, 1 - 2.0**-40])])
    m0, shift = requant_multiplier(real)
    assert bool(((m0 >= 2**30) & (shift >= 1) & (shift <= 63)).all())
    approx = m0.double() * torch.pow(2.0, -shift.double())
    assert bool(((approx - real).abs() <= real * 2.0**-31).all())
    zero, _ = requant_multiplier(torch.tensor([0.0, 2.0**-50], dtype=torch.float64))
    assert zero.tolist() == [0, 0]
    for bad in (-1.0, float("inf"), float("nan"), 2.0**30):
        with pytest.raises(UserError, match="requantization multiplier"):
            requant_multiplier(torch.tensor([bad], dtype=torch.float64))


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
def test_requantized_codes_survive_relu_maxpool_and_the_next_quantize(gen, backend, device):
    """Why requant=integer may hand the next layer fp32 values: code * s, through ReLU and max-pool, quantized
    again at the same fp32 scale s, is the code (ReLU'd, max-pooled) again, for every code and any scale."""
    scales = torch.cat([torch.exp(torch.empty(2000).uniform_(-30, 10, generator=gen)),
                        torch.tensor([1 / 255, 1 / 127, 0.1, 3.4e-38, 1e30])])
    for signed, (lo, hi) in ((True, (-128, 127)), (False, (0, 255))):
        c = torch.arange(lo, hi + 1, dtype=torch.float32)
        for s in scales:
            s = s.reshape(()).to(device)
            x = (c.to(device) * s).reshape(1, 1, -1, 1).repeat(1, 1, 1, 2).contiguous()
            back = ops.quantize(x, s, signed, backend=backend).cpu()
            assert torch.equal(back[0, 0, :, 0].float(), c), float(s)
            pooled = torch.nn.functional.max_pool2d(torch.relu(x), (2, 2)).contiguous()
            codes = ops.quantize(pooled, s, signed, backend=backend).cpu().float().flatten()
            assert torch.equal(codes, c.clamp(min=0).reshape(-1, 2).amax(1)), float(s)


@pytest.mark.parametrize("backend,device", backend_params())
def test_opcheck_requantize(gen, backend, device):
    bias, m0, shift = _requant_args(gen, 3)
    acc = torch.randint(-1000, 1000, (4, 3, 5, 5), generator=gen, dtype=torch.int32)
    args = tuple(t.to(device) for t in (acc, bias, m0, shift, torch.tensor(0.05)))
    torch.library.opcheck(torch.ops.approx.requantize.default, (*args, -128, 127))
    torch.library.opcheck(torch.ops.approx.requantize.default, (args[0][:, :, 0, 0].contiguous(), *args[1:], 0, 255))


@pytest.mark.parametrize("backend,device", backend_params())
def test_opcheck_requantize_codes(gen, backend, device):
    bias, m0, shift = _requant_args(gen, 3)
    acc = torch.randint(-1000, 1000, (4, 3, 5, 5), generator=gen, dtype=torch.int32)
    args = tuple(t.to(device) for t in (acc, bias, m0, shift))
    torch.library.opcheck(torch.ops.approx.requantize_codes.default, (*args, -128, 127, True))
    torch.library.opcheck(torch.ops.approx.requantize_codes.default,
                          (args[0][:, :, 0, 0].contiguous(), *args[1:], 0, 255, False))


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
def test_requantize_codes_rejects_a_range_outside_its_dtype(backend, device):
    acc = torch.zeros(4, 3, dtype=torch.int32, device=device)
    i3 = torch.zeros(3, dtype=torch.int32, device=device)
    for qmin, qmax, signed in ((-128, 128, True), (-1, 255, False), (5, 5, True)):
        with pytest.raises((RuntimeError, ValueError), match="qmin"):
            ops.requantize_codes(acc, i3, i3, i3, qmin, qmax, signed, backend=backend)
    if backend != "python":
        with pytest.raises(RuntimeError, match="shift.*3 element"):
            torch.ops.approx.requantize_codes(acc, i3, i3, i3[:2], -128, 127, True)


@pytest.mark.parametrize("backend,device", backend_params())
def test_requantize_rejects_bad_inputs(backend, device):
    acc = torch.zeros(4, 3, dtype=torch.int32, device=device)
    i3, s = torch.zeros(3, dtype=torch.int32, device=device), torch.tensor(0.1, device=device)
    op = torch.ops.approx.requantize
    with pytest.raises(RuntimeError, match="acc.*int32"):
        op(acc.float(), i3, i3, i3, s, -128, 127)
    with pytest.raises(RuntimeError, match="bias.*int32"):
        op(acc, i3.float(), i3, i3, s, -128, 127)
    with pytest.raises(RuntimeError, match="shift.*3 element"):
        op(acc, i3, i3, i3[:2], s, -128, 127)
    with pytest.raises(RuntimeError, match="out_scale.*float32"):
        op(acc, i3, i3, i3, s.double(), -128, 127)
    with pytest.raises(RuntimeError, match="qmin"):
        op(acc, i3, i3, i3, s, 0, 256)


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_vectorised_and_tail_lengths(gen, backend, device, signed):
    """Lengths that are whole 4-element vectors (the GPU's 16-byte path) and ones that are not, with a NaN
    in the last vector: the same codes as the reference, and the flag raised."""
    s = torch.tensor(0.0123)
    x = _tricky_inputs(gen, float(s))
    for n in (x.numel() // 4 * 4, x.numel() // 4 * 4 - 1, 4, 8 * 1024 * 1024):
        xi = x[:n] if n <= x.numel() else torch.randn(n, generator=gen)
        expected = reference.reference_quantize(xi, s, signed)
        flag = torch.zeros(1, dtype=torch.bool, device=device)
        got = ops.quantize(xi.to(device), s.to(device), signed, backend=backend, nonfinite=flag).cpu()
        assert torch.equal(got, expected) and not bool(flag), n
        bad = xi.clone()
        bad[-1] = float("nan")
        ops.quantize(bad.to(device), s.to(device), signed, backend=backend, nonfinite=flag)
        assert bool(flag), n


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("shape", [(3, 6, 4, 5), (2, 16, 8, 8), (2, 3, 1, 4), (64, 16, 32, 32), (4, 5, 3, 3),
                                   (2, 8, 7, 7), (6, 10), (4099, 12), (5, 7), (4, 64, 100, 100), (4097, 640)])
def test_dequantize_and_requantize_per_channel_on_conv_shapes(gen, backend, device, shape):
    """Conv outputs [B, N, H, W] and Linear outputs [M, N]: planes of whole 4-element vectors (the GPU's vector
    kernels a plane at a time), 4-element vectors across planes or rows (element by element: 7x7, [M, N]) and
    neither (the scalar kernels); each element's channel scale, bias and multiplier are its own (a mix-up shows).
    The last two take several loop iterations a GPU thread, the last with one step of its two."""
    acc = torch.randint(-(2**20), 2**20, shape, generator=gen, dtype=torch.int32)
    sa = torch.tensor(0.0031)
    sw, fbias = torch.rand(shape[1], generator=gen) + 0.01, torch.randn(shape[1], generator=gen) * 50
    args = (acc, sa, sw, fbias)
    assert torch.equal(ops.dequantize(*(t.to(device) for t in args), backend=backend).cpu(),
                       reference.reference_dequantize(*args))
    bias, _, _ = _requant_args(gen, shape[1])
    bias //= 4096
    m0, shift = requant_multiplier(torch.rand(shape[1], generator=gen, dtype=torch.float64) * 1e-4)
    rargs = (acc, bias, m0, shift, torch.tensor(0.0123))
    for qrange in ((-128, 127), (0, 255), (0, 127)):
        got = ops.requantize(*(t.to(device) for t in rargs), *qrange, backend=backend).cpu()
        assert torch.equal(got, reference.reference_requantize(*rargs, *qrange))
        _check_codes(got, rargs, *qrange, backend, device)


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
@pytest.mark.parametrize("qrange", [(-128, 127), (0, 255)], ids=["signed", "unsigned"])
def test_requantize_at_every_code_boundary_for_every_shift(gen, backend, device, qrange):
    """For each shift 1..63 and random M0, the accumulators on both sides of every rounding tie (k + 1/2 for each
    code k of the range and one beyond each end) and on the tie itself where it is an integer: the kernels equal
    the int64 reference and the definition in exact integers. The CPU kernel computes shifts up to 43 in double
    (the proof is beside it) and larger ones in int64; this covers the switch and both sides of it."""
    qmin, qmax = qrange
    shifts = torch.arange(1, 64, dtype=torch.int32)
    n = shifts.numel()
    m0 = torch.randint(2**30, 2**31 - 1, (n,), generator=gen, dtype=torch.int32)
    bias = torch.randint(-(2**20), 2**20, (n,), generator=gen, dtype=torch.int32)
    ks = torch.arange(qmin - 1, qmax + 2, dtype=torch.float64)
    cols = []
    for c in range(n):
        # t = acc + bias where (t * M0) / 2^shift crosses k + 1/2; Python integers, so the ties are exact
        ties = [((2 * int(k) + 1) << (int(shifts[c]) - 1)) // int(m0[c]) for k in ks]
        t = torch.tensor([v + d for v in ties for d in (-1, 0, 1, 2)], dtype=torch.int64)
        cols.append((t - int(bias[c])).clamp(-(2**31), 2**31 - 1))
    rows = max(len(col) for col in cols)
    acc = torch.stack([torch.cat([col, col[:rows - len(col)]]) if len(col) < rows else col for col in cols], 1)
    acc = acc.to(torch.int32).contiguous()
    out_scale = torch.tensor(0.0371)
    args = (acc, bias, m0, shifts, out_scale)
    got = ops.requantize(*(t.to(device) for t in args), qmin, qmax, backend=backend).cpu()
    assert torch.equal(got, reference.reference_requantize(*args, qmin, qmax))
    _check_codes(got, args, qmin, qmax, backend, device)
    want = torch.tensor([[_exact_requant(int(acc[i, c]) + int(bias[c]), int(m0[c]), int(shifts[c]), qmin, qmax)
                          for c in range(n)] for i in range(0, rows, max(1, rows // 256))], dtype=torch.float32)
    assert torch.equal(got[::max(1, rows // 256)], want * out_scale)
    # where M0 / 2^shift < 1 (one accumulator step per code or finer) and the ties fit int32, every code is reached
    reach = (shifts >= 32) & (shifts <= 50)
    assert set((got[:, reach] / out_scale).round().unique().tolist()) >= set(range(qmin, qmax + 1))


# (shift, code k, M0, acc) with acc * M0 = (2k + 1) * 2^(shift - 1) - 1: one below a tie, so the code is k, while
# the product needs more than 53 bits and a double would round it onto the tie (code k + 1). Found by factoring
# (2k + 1) * 2^(shift - 1) - 1 (sympy.factorint) for an M0 in [2^30, 2^31) with acc below 2^31.
NEAR_TIES = [(46, 126, 1436219855, 6197969), (46, 252, 1705451461, 10418419), (47, 123, 1673679843, 10384949),
             (47, 249, 1076765265, 32610639), (50, 124, 1097736941, 127694107), (50, 251, 1593667385, 177680631),
             (53, 117, 1117329133, 947210523), (53, 250, 1150840061, 1960570795)]


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
def test_requantize_one_below_a_tie_that_a_double_would_round_onto(backend, device):
    shift, k, m0, acc = (torch.tensor(col, dtype=torch.int32) for col in zip(*NEAR_TIES))
    assert all(int(a) * int(m) == (2 * int(c) + 1) * 2 ** (int(s) - 1) - 1 for s, c, m, a in zip(shift, k, m0, acc))
    n = len(NEAR_TIES)
    acc = acc.view(1, n, 1).repeat(2, 1, 6).contiguous()  # planes of 6: a vector of 4 and a scalar tail
    args = (acc, torch.zeros(n, dtype=torch.int32), m0, shift, torch.tensor(1.0))
    got = ops.requantize(*(t.to(device) for t in args), 0, 255, backend=backend).cpu()
    assert torch.equal(got, k.float().view(1, n, 1).expand(2, n, 6))
    _check_codes(got, args, 0, 255, backend, device)


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_vector_lanes_equal_the_scalar_tail(backend, device, signed):
    """Each special value (NaN, +-Inf, the largest floats, ties, signed zeros) at every lane of a vector block
    gives the code a lone element (the scalar loop) gives it, and raises the flag exactly for NaN and Inf."""
    s = torch.tensor(0.5)
    specials = [float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 63.75, -64.25, 127.75, -0.0, 0.0, 0.25,
                0.75, -0.25, 1e-45]
    for value in specials:
        lone_flag = torch.zeros(1, dtype=torch.bool, device=device)
        lone = ops.quantize(torch.tensor([value], device=device), s.to(device), signed, backend=backend,
                            nonfinite=lone_flag).cpu()
        for lane in range(33):
            x = torch.full((33,), 1.0)
            x[lane] = value
            flag = torch.zeros(1, dtype=torch.bool, device=device)
            got = ops.quantize(x.to(device), s.to(device), signed, backend=backend, nonfinite=flag).cpu()
            assert int(got[lane]) == int(lone[0]) and bool(flag) == bool(lone_flag), (value, lane)
            assert bool(flag) == (value != value or abs(value) == float("inf")), (value, lane)
            assert torch.equal(torch.cat([got[:lane], got[lane + 1:]]), torch.full((32,), 2, dtype=got.dtype))


@needs_compiled
def test_requantize_scalar_variant_equals_reference():
    """APPROX_RUN_CPU_ISA=base: requantize's scalar loop, which a CPU without AVX2 runs, through the same
    checks (every code boundary and shift, the ties, the unbounded-integer definition)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "cpp and requantize and not scalar_variant"], cwd=Path(__file__).parents[2],
                         capture_output=True, text=True, env={**os.environ, "APPROX_RUN_CPU_ISA": "base"},
                         timeout=600)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
