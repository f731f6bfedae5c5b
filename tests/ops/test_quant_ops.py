"""approx::quantize / approx::dequantize: the fused ends of an approx layer equal their references
(fake-quant's integers; the eager dequantize expression) bit for bit on every backend."""
import pytest
import torch

from runner import ops

from .conftest import backend_params


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
        expected = ops.reference_quantize(x, s, signed)
        got = ops.quantize(x.to(device), s.to(device), signed, backend=backend).cpu()
        assert got.dtype == expected.dtype and torch.equal(got, expected), scale


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("shape", [(5, 7), (3, 6, 4, 5), (0, 4)])
def test_dequantize_equals_eager_expression(gen, backend, device, shape):
    acc = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int32)
    sa = torch.rand((), generator=gen) * 0.01
    sw, bias = torch.rand(shape[1], generator=gen), torch.randn(shape[1], generator=gen)
    expected = ops.reference_dequantize(acc, sa, sw, bias)
    got = ops.dequantize(*(t.to(device) for t in (acc, sa, sw, bias)), backend=backend).cpu()
    assert torch.equal(got, expected)


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
    assert torch.equal(got[keep], ops.reference_quantize(x, s, True)[keep])
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
