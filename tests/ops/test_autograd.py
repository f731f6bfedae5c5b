"""The differentiable layer ops approx::qlinear / approx::qconv2d: opcheck with its autograd checks, on every
backend and gradient, and their gradients against torch.autograd.gradcheck-style references."""
import pytest
import torch

from runner import lut_slopes, ops_autograd, reference
from runner.multipliers.core import exact_lut
from runner.quant import weight_scale, quantize_weight

from .conftest import backend_params, random_lut

GRADS = ["ste", "lut"]


def all_backends():
    return [pytest.param("python", "cpu", id="python")] + backend_params()


def _operands(gen, x_shape, w_shape, signed, lut, device, learn_scale=False):
    x = torch.randn(x_shape, generator=gen)
    if not signed:
        x = x.abs()
    w = torch.randn(w_shape, generator=gen) * 0.2
    ws = weight_scale(w, "per_channel")
    codes = quantize_weight(w, ws).contiguous()
    # a scale that clips the largest inputs, so the clipping mask matters
    act = torch.tensor(float(x.abs().max()) * 0.8 / (127 if signed else 255))
    bias = torch.randn(w_shape[0], generator=gen)
    slope_a, slope_w = lut_slopes.slope_tables(lut, signed, 2)
    t = [v.to(device) for v in (x, w, bias, codes, ws, act, lut, slope_a, slope_w)]
    for i in (0, 1, 2) + ((5,) if learn_scale else ()):
        t[i].requires_grad_(True)
    return t


@pytest.mark.parametrize("backend,device", all_backends())
@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_opcheck_qlinear(gen, backend, device, grad, signed):
    lut = random_lut(gen, -(2**12), 2**12)
    args = _operands(gen, (6, 11), (5, 11), signed, lut, device, learn_scale=True)
    torch.library.opcheck(torch.ops.approx.qlinear.default, (*args, signed, backend, "auto", grad))


@pytest.mark.parametrize("backend,device", all_backends())
@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_opcheck_qconv2d(gen, backend, device, grad, signed):
    lut = random_lut(gen, -(2**12), 2**12)
    args = _operands(gen, (2, 4, 7, 6), (6, 2, 3, 2), signed, lut, device, learn_scale=True)
    torch.library.opcheck(torch.ops.approx.qconv2d.default,
                          (*args, [2, 1], [1, 0], [1, 2], 2, signed, backend, "auto", grad))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_lut_gradient_is_the_chain_rule_through_the_slopes(gen, signed):
    """An independent derivation of the `lut` gradient of a linear layer, element by element in float64."""
    lut = random_lut(gen, -(2**12), 2**12)
    x, w, b, codes, ws, act, lut_, sa, sw = _operands(gen, (3, 4), (2, 4), signed, lut, "cpu")
    g = torch.randn(3, 2, generator=gen)
    out = ops_autograd.qlinear(x, w, b, codes, ws, act, lut_, sa, sw, signed, "python", "auto", "lut")
    out.backward(g)
    a = reference.reference_quantize(x.detach(), act, signed).to(torch.int64)
    qmin, qmax = (-128, 127) if signed else (0, 255)
    row = a + 128 if signed else a
    inside = ((x.detach() / act).round() >= qmin) & ((x.detach() / act).round() <= qmax)
    gx = torch.zeros(3, 4, dtype=torch.float64)
    gw = torch.zeros(2, 4, dtype=torch.float64)
    for m in range(3):
        for k in range(4):
            for n in range(2):
                col = int(codes[n, k]) + 128
                gx[m, k] += g[m, n] * ws[n] * sa[row[m, k], col]
                gw[n, k] += g[m, n] * act * sw[row[m, k], col]
    torch.testing.assert_close(x.grad, (gx * inside).float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, gw.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, g.sum(0))


def test_slope_tables_of_an_analytic_table():
    """P = a * w + 3a (+ a square in w): slopes w + 3 along a everywhere, 2a * w-ish along w, edges one-sided."""
    i = torch.arange(256, dtype=torch.int64)
    a, w = (i - 128)[:, None], (i - 128)[None, :]
    lut = (a * w + 3 * a + w * w).to(torch.int32)
    sa, sw = lut_slopes.slope_tables(lut, True)
    assert torch.equal(sa, (w + 3).expand(256, 256).float())
    inner = (a + 2 * w).expand(256, 256).float()
    assert torch.equal(sw[:, 1:255], inner[:, 1:255])
    assert torch.equal(sw[:, 0], (a + 2 * w[:, 0] + 1).flatten().float())      # one-sided: w^2 step
    sa4, _ = lut_slopes.slope_tables(lut, True, 4)
    assert torch.equal(sa4, sa)                                                    # linear in a: any window
    exact_u = exact_lut(signed=False)
    su_a, su_w = lut_slopes.slope_tables(exact_u, False)
    assert torch.equal(su_a, (i - 128)[None, :].expand(256, 256).float())        # d(a*w)/da = w (sign folded)
    assert torch.equal(su_w, i[:, None].expand(256, 256).float())
