"""Compiled lut_grad_a / lut_grad_w kernels (cpp, and cuda where built) against the float64 python
reference (runner.reference.reference_lut_grad_*), the exact-multiplier identities, opcheck and errors.

The CPU kernels pick an algorithm per call (direct or table/histogram, see
extensions/csrc/cpu/lut_grad_cpu.cpp); APPROX_RUN_GRAD_ALGO forces one, so every shape runs
through each of them as well as through the automatic choice."""
import os
import subprocess
import sys

import pytest
import torch

from runner import lut_slopes, ops, reference

from .conftest import BACKENDS, backend_params, codes, exact_lut, random_lut, weights

SIGNS = [pytest.param(True, id="signed"), pytest.param(False, id="unsigned")]
RTOL = 1e-5  # relative to sum |grad * slope| over the summed terms

# (M, K, N). LeNet-5 rows-form shapes (scaled down where the reference would be slow), both sides
# of the CPU rule, K and N off multiples of 8, N = 1, M = 1, and empty dimensions.
SHAPES = [
    (0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0),
    (1, 1, 1), (1, 25, 6), (3, 7, 2), (37, 13, 1), (70, 9, 17), (65, 8, 8),
    (64, 84, 10),     # fc3, batch 64
    (64, 120, 84),    # fc2, batch 64
    (64, 256, 120),   # fc1, batch 64
    (2304, 25, 6),    # conv1, batch 4 (table on the CPU)
    (1024, 150, 16),  # conv2, batch 16 (table on the CPU)
    (600, 33, 130),   # wide N (Np = 136)
    (20000, 7, 3),    # more rows than one float histogram block (16384)
]


def backend_algo_params():
    """(backend, device, algo): the CPU kernels with every algorithm, CUDA with its only one."""
    out = []
    for p in backend_params():
        backend, device = p.values
        for algo in (("auto", "direct", "table") if backend == "cpp" else ("auto",)):
            out.append(pytest.param(backend, device, algo, id=f"{p.id}-{algo}", marks=p.marks))
    return out


@pytest.fixture
def force_algo(monkeypatch):
    def set_(algo):
        monkeypatch.setenv("APPROX_RUN_GRAD_ALGO", algo)
    return set_


def slope_kinds(gen, signed):
    """(name, slope for grad_a, slope for grad_w): a multiplier's slope tables and random floats."""
    sa, sw = lut_slopes.slope_tables(random_lut(gen), signed)
    rnd = torch.randn((256, 256), generator=gen)
    return [("lut", sa, sw), ("randn", rnd, rnd)]


def grad_of(gen, m, n):
    return torch.randn((m, n), generator=gen)


def check_close(got, want, scale, what):
    assert got.dtype == torch.float32 and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    got = got.cpu().to(torch.float64)
    err = (got - want.to(torch.float64)).abs()
    tol = RTOL * scale.to(torch.float64) + 1e-30
    assert torch.isfinite(got).all(), what
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} beyond tolerance; worst "
                           f"err {float(err.max()):.3g}, tol there {float(tol.flatten()[err.argmax()]):.3g}")


def run_both(a, w, g, sa, sw, device):
    d = torch.device(device)
    return (torch.ops.approx.lut_grad_a(a.to(d), w.to(d), g.to(d), sa.to(d)),
            torch.ops.approx.lut_grad_w(a.to(d), w.to(d), g.to(d), sw.to(d)))


def expect_both(a, w, g, sa, sw):
    """Reference results and the per-entry tolerance scales (the same sums over |terms|)."""
    want_a, want_w = reference.reference_lut_grad_a(a, w, g, sa), reference.reference_lut_grad_w(a, w, g, sw)
    scale_a = reference.reference_lut_grad_a(a, w, g.abs(), sa.abs())
    scale_w = reference.reference_lut_grad_w(a, w, g.abs(), sw.abs())
    return want_a, want_w, scale_a, scale_w


@pytest.mark.parametrize("backend,device,algo", backend_algo_params())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("signed", SIGNS)
def test_matches_reference(gen, force_algo, backend, device, algo, shape, signed):
    force_algo(algo)
    m, k, n = shape
    a, w, g = codes(gen, (m, k), signed), weights(gen, (n, k)), grad_of(gen, m, n)
    for name, sa, sw in slope_kinds(gen, signed):
        got_a, got_w = run_both(a, w, g, sa, sw, device)
        want_a, want_w, scale_a, scale_w = expect_both(a, w, g, sa, sw)
        check_close(got_a, want_a, scale_a, f"lut_grad_a {name}")
        check_close(got_w, want_w, scale_w, f"lut_grad_w {name}")


@pytest.mark.parametrize("backend,device,algo", backend_algo_params())
@pytest.mark.parametrize("signed", SIGNS)
def test_relu_like_codes(gen, force_algo, backend, device, algo, signed):
    """Mostly-zero activations (after a ReLU): long runs of rows hit the same slope row."""
    force_algo(algo)
    m, k, n = 5000, 25, 6
    a = codes(gen, (m, k), signed)
    a[torch.rand((m, k), generator=gen) < 0.7] = 0
    a[:300] = 0
    w, g = weights(gen, (n, k)), grad_of(gen, m, n)
    for name, sa, sw in slope_kinds(gen, signed):
        got_a, got_w = run_both(a, w, g, sa, sw, device)
        want_a, want_w, scale_a, scale_w = expect_both(a, w, g, sa, sw)
        check_close(got_a, want_a, scale_a, f"lut_grad_a {name}")
        check_close(got_w, want_w, scale_w, f"lut_grad_w {name}")


@pytest.mark.parametrize("backend,device,algo", backend_algo_params())
@pytest.mark.parametrize("shape", [(64, 120, 84), (2304, 25, 6), (1024, 150, 16), (37, 13, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("signed", SIGNS)
def test_exact_lut_is_matmul(gen, force_algo, backend, device, algo, shape, signed):
    """For the exact multiplier the slopes are the operands themselves (dP/da = w, dP/dw = a), so
    the two gradients are the straight-through ones: grad @ w and grad^T @ a."""
    force_algo(algo)
    m, k, n = shape
    a, w, g = codes(gen, (m, k), signed), weights(gen, (n, k)), grad_of(gen, m, n)
    sa, sw = lut_slopes.slope_tables(exact_lut(signed), signed)
    got_a, got_w = run_both(a, w, g, sa, sw, device)
    g64, w64, a64 = g.double(), w.double(), a.double()
    check_close(got_a, g64 @ w64, g64.abs() @ w64.abs(), "lut_grad_a vs grad @ w")
    check_close(got_w, g64.t() @ a64, g64.abs().t() @ a64.abs(), "lut_grad_w vs grad^T @ a")
    # and in float32, as the straight-through backward computes it
    torch.testing.assert_close(got_a.cpu(), g @ w.float(), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got_w.cpu(), g.t() @ a.float(), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("backend,device,algo", backend_algo_params())
def test_deterministic(gen, force_algo, backend, device, algo):
    """Same inputs, same bits: no float atomics on CUDA; on the CPU, also across thread counts
    (every output is summed by one thread in a fixed order)."""
    force_algo(algo)
    a, w, g = codes(gen, (3000, 40), True), weights(gen, (12, 40)), grad_of(gen, 3000, 12)
    sa, sw = lut_slopes.slope_tables(random_lut(gen), True)
    first = run_both(a, w, g, sa, sw, device)
    again = run_both(a, w, g, sa, sw, device)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    if backend == "cpp":
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = run_both(a, w, g, sa, sw, device)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(first[0], one[0]) and torch.equal(first[1], one[1])


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", SIGNS)
def test_opcheck(gen, backend, device, signed):
    for m, k, n in [(9, 17, 5), (300, 25, 6), (0, 4, 3)]:
        a, w = codes(gen, (m, k), signed).to(device), weights(gen, (n, k)).to(device)
        g = grad_of(gen, m, n).to(device)
        sa, sw = (s.to(device) for s in lut_slopes.slope_tables(random_lut(gen), signed))
        torch.library.opcheck(torch.ops.approx.lut_grad_a.default, (a, w, g, sa))
        torch.library.opcheck(torch.ops.approx.lut_grad_w.default, (a, w, g, sw))


def ok_args():
    return (torch.zeros((4, 8), dtype=torch.int8), torch.zeros((3, 8), dtype=torch.int8),
            torch.zeros((4, 3)), torch.zeros((256, 256)))


BAD = [  # (name, mutate(a, w, grad, slope) -> args, message fragment)
    ("a float", lambda a, w, g, s: (a.float(), w, g, s), "must be int8"),
    ("a int32", lambda a, w, g, s: (a.int(), w, g, s), "must be int8"),
    ("w uint8", lambda a, w, g, s: (a, w.to(torch.uint8), g, s), "weight codes `w` must be int8"),
    ("a 1-d", lambda a, w, g, s: (a.reshape(-1), w, g, s), "expected a [M, K]"),
    ("w 3-d", lambda a, w, g, s: (a, w[None], g, s), "expected a [M, K]"),
    ("K mismatch", lambda a, w, g, s: (a, w[:, :5].contiguous(), g, s), "K=8 columns but w has K=5"),
    ("grad float64", lambda a, w, g, s: (a, w, g.double(), s), "`grad` must be a float32 tensor of shape [M, N]"),
    ("grad shape", lambda a, w, g, s: (a, w, g.t().contiguous(), s), "`grad` must be a float32 tensor of shape [M, N]"),
    ("grad 1-d", lambda a, w, g, s: (a, w, g.reshape(-1), s), "`grad` must be a float32 tensor of shape [M, N]"),
    ("slope int32", lambda a, w, g, s: (a, w, g, s.int()), "`slope` must be a float32 tensor of shape [256, 256]"),
    ("slope 255", lambda a, w, g, s: (a, w, g, s[:255]), "`slope` must be a float32 tensor of shape [256, 256]"),
    ("slope transposed", lambda a, w, g, s: (a, w, g, s.t()), "`slope` must be contiguous"),
    ("grad strided", lambda a, w, g, s: (a, w, torch.zeros((3, 4), device=g.device).t(), s),
     "`grad` must be contiguous"),
    ("a strided", lambda a, w, g, s: (torch.zeros((4, 16), dtype=torch.int8, device=a.device)[:, ::2], w, g, s),
     "`a` must be contiguous"),
    ("w strided", lambda a, w, g, s: (a, torch.zeros((3, 16), dtype=torch.int8, device=w.device)[:, ::2], g, s),
     "`w` must be contiguous"),
]


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("op", ["lut_grad_a", "lut_grad_w"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs(backend, device, op, case):
    _, mutate, fragment = case
    args = mutate(*(t.to(device) for t in ok_args()))
    with pytest.raises(RuntimeError) as exc:
        getattr(torch.ops.approx, op)(*args)
    msg = str(exc.value)
    assert op in msg and fragment in msg, msg


CUDA_ONLY = [p for p in backend_params() if p.values[0] == "cuda"] or [
    pytest.param("cuda", "cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skip(reason="no CUDA backend")])]


@pytest.mark.parametrize("backend,device", CUDA_ONLY)
@pytest.mark.parametrize("op", ["lut_grad_a", "lut_grad_w"])
def test_mixed_devices(backend, device, op):
    a, w, g, s = (t.to(device) for t in ok_args())
    with pytest.raises(RuntimeError, match=f"{op}: a, w, grad and slope must be on the same device"):
        getattr(torch.ops.approx, op)(a, w, g, s.cpu())


@pytest.mark.skipif(not any(b == "cpp" for b, _ in BACKENDS), reason="runner._C not built")
def test_bad_forced_algo(monkeypatch):
    monkeypatch.setenv("APPROX_RUN_GRAD_ALGO", "fastest")
    with pytest.raises(RuntimeError, match="lut_grad_a: APPROX_RUN_GRAD_ALGO='fastest'"):
        torch.ops.approx.lut_grad_a(*ok_args())


def test_python_wrappers(gen):
    """runner.ops.lut_grad_* with backend=python is the reference; cpp runs the CPU kernel."""
    a, w, g = codes(gen, (20, 9), True), weights(gen, (5, 9)), grad_of(gen, 20, 5)
    sa, sw = lut_slopes.slope_tables(random_lut(gen), True)
    assert torch.equal(ops.lut_grad_a(a, w, g, sa, backend="python"), reference.reference_lut_grad_a(a, w, g, sa))
    assert torch.equal(ops.lut_grad_w(a, w, g, sw, backend="python"), reference.reference_lut_grad_w(a, w, g, sw))
    if any(b == "cpp" for b, _ in BACKENDS):
        want_a, want_w, scale_a, scale_w = expect_both(a, w, g, sa, sw)
        check_close(ops.lut_grad_a(a, w, g, sa, backend="cpp"), want_a, scale_a, "cpp lut_grad_a")
        check_close(ops.lut_grad_w(a, w, g, sw, backend="cpp"), want_w, scale_w, "cpp lut_grad_w")


@pytest.mark.skipif(not any(b == "cpp" for b, _ in BACKENDS), reason="runner._C not built")
@pytest.mark.parametrize("isa", ["avx2", "base"])
def test_cpu_isa_variants(isa):
    """The baseline (non-AVX2) variant computes the same sums, with both algorithms."""
    code = (
        "import os, torch\n"
        "from runner import lut_slopes\n"
        "from tests.ops.conftest import codes, random_lut, weights\n"
        "from tests.ops.test_grad_kernels import check_close, expect_both\n"
        "gen = torch.Generator().manual_seed(5)\n"
        "for algo in ('direct', 'table'):\n"
        "    os.environ['APPROX_RUN_GRAD_ALGO'] = algo\n"
        "    for signed in (True, False):\n"
        "        for m, k, n in ((70, 9, 17), (600, 25, 6), (200, 150, 16), (64, 120, 84), (37, 13, 1)):\n"
        "            a, w = codes(gen, (m, k), signed), weights(gen, (n, k))\n"
        "            g = torch.randn((m, n), generator=gen)\n"
        "            sa, sw = lut_slopes.slope_tables(random_lut(gen), signed)\n"
        "            want_a, want_w, scale_a, scale_w = expect_both(a, w, g, sa, sw)\n"
        "            check_close(torch.ops.approx.lut_grad_a(a, w, g, sa), want_a, scale_a, (algo, m, k, n))\n"
        "            check_close(torch.ops.approx.lut_grad_w(a, w, g, sw), want_w, scale_w, (algo, m, k, n))\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "APPROX_RUN_CPU_ISA": isa}, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
