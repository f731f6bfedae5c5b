"""Compiled kernels (cpp, and cuda where built) bit-exact against the python reference."""
import os
import subprocess
import sys

import pytest
import torch

from runner import ops, reference
from runner.errors import UserError

from .conftest import BACKENDS, backend_params, codes, cpp_only, exact_lut, random_lut, weights

ALGOS = ["direct", "expanded", "tiled", "auto"]  # tiled: cpp only (skip_other)
SIGNS = [pytest.param(True, id="signed"), pytest.param(False, id="unsigned")]
LUTS = {  # int16 tables, int32 tables, and sums that wrap around int32
    "lut16": lambda g: random_lut(g, -(2**15) + 1, 2**15),
    "lut32": lambda g: random_lut(g, -(2**24), 2**24),
    "wrap": lambda g: random_lut(g, -(2**31), 2**31 - 1),
}


def skip_other(backend, algo):
    if algo not in ("auto", "direct", "expanded") and algo not in cpp_only(backend, algo):
        pytest.skip(f"{algo} is a cpp variant")


def to(dev, *ts):
    return [t.to(dev) for t in ts]


def assert_prints_ok(code, **env):
    """Runs `code` in a fresh Python (from the repo root, with extra environment) and checks
    that it exits cleanly after printing 'ok'."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("signed", SIGNS)
@pytest.mark.parametrize("lut_kind", list(LUTS))
def test_linear_random(gen, backend, device, algo, signed, lut_kind):
    skip_other(backend, algo)
    lut = LUTS[lut_kind](gen)
    for m, k, n in [(1, 1, 1), (1, 84, 10), (37, 50, 21), (300, 256, 120), (5, 3, 130)]:
        a, w = codes(gen, (m, k), signed), weights(gen, (n, k))
        want = reference.reference_lut_linear(a, w, lut)
        got = ops.lut_linear(*to(device, a, w, lut), backend=backend, algo=algo).cpu()
        assert torch.equal(got, want), (m, k, n)


CONV_CASES = [  # (B, C, H, W), (N, kh, kw), stride, padding, dilation, groups
    ((1, 1, 28, 28), (6, 5, 5), 1, 0, 1, 1),      # LeNet conv1, batch 1
    ((3, 6, 12, 12), (16, 5, 5), 1, 0, 1, 1),     # LeNet conv2
    ((2, 4, 9, 11), (6, 3, 2), (2, 1), (1, 2), (1, 2), 2),
    ((2, 6, 8, 8), (6, 3, 3), 2, 1, 2, 6),        # depthwise
    ((1, 3, 5, 5), (40, 5, 5), 1, 2, 1, 1),       # more channels than one tile, padding
    ((2, 2, 7, 6), (3, 1, 1), (3, 2), (0, 3), 1, 1),
]


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("signed", SIGNS)
@pytest.mark.parametrize("case", CONV_CASES, ids=[f"case{i}" for i in range(len(CONV_CASES))])
def test_conv_random(gen, backend, device, algo, signed, case):
    skip_other(backend, algo)
    ashape, (n, kh, kw), stride, padding, dilation, groups = case
    lut = random_lut(gen)
    a = codes(gen, ashape, signed)
    w = weights(gen, (n, ashape[1] // groups, kh, kw))
    want = reference.reference_lut_conv2d(a, w, lut, stride, padding, dilation, groups)
    got = ops.lut_conv2d(*to(device, a, w, lut), stride, padding, dilation, groups,
                         backend=backend, algo=algo).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", SIGNS)
def test_random_shapes(backend, device, signed):
    g = torch.Generator().manual_seed(7)
    for trial in range(12):
        r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        groups = r(1, 3)
        c, n = groups * r(1, 3), groups * r(1, 20)
        kh, kw = r(1, 4), r(1, 4)
        stride, padding, dilation = (r(1, 3), r(1, 2)), (r(0, 2), r(0, 2)), (r(1, 2), r(1, 2))
        h = dilation[0] * (kh - 1) + 1 + r(0, 6)
        wd = dilation[1] * (kw - 1) + 1 + r(0, 6)
        lut = random_lut(g)
        a = codes(g, (r(1, 3), c, h, wd), signed)
        w = weights(g, (n, c // groups, kh, kw))
        want = reference.reference_lut_conv2d(a, w, lut, stride, padding, dilation, groups)
        for algo in ("direct", "expanded", *cpp_only(backend, "tiled")):
            got = ops.lut_conv2d(*to(device, a, w, lut), stride, padding, dilation, groups,
                                 backend=backend, algo=algo).cpu()
            assert torch.equal(got, want), (trial, algo)


@pytest.mark.parametrize("backend,device", backend_params())
@pytest.mark.parametrize("signed", SIGNS)
def test_exact_lut_is_integer_arithmetic(gen, backend, device, signed):
    lut = exact_lut(signed)
    a, w = codes(gen, (64, 120), signed), weights(gen, (84, 120))
    got = ops.lut_linear(*to(device, a, w, lut), backend=backend).cpu()
    assert torch.equal(got.long(), a.long() @ w.long().t())
    a, w = codes(gen, (4, 6, 12, 12), signed), weights(gen, (16, 6, 5, 5))
    got = ops.lut_conv2d(*to(device, a, w, lut), padding=1, backend=backend).cpu()
    want = torch.nn.functional.conv2d(a.double(), w.double(), padding=1)
    assert torch.equal(got.double(), want)


@pytest.mark.parametrize("backend,device", backend_params())
def test_weights_changed_in_place(gen, backend, device):
    """Kernels may reuse work across calls (the CPU expanded table); new weights must show."""
    lut = random_lut(gen)
    a, w = codes(gen, (200, 64), False), weights(gen, (32, 64))
    a, w, lut = to(device, a, w, lut)
    ops.lut_linear(a, w, lut, backend=backend, algo="expanded")
    w[3, 5] = -w[3, 5] if w[3, 5] != 0 else 1
    lut[7, 9] += 1
    got = ops.lut_linear(a, w, lut, backend=backend, algo="expanded").cpu()
    assert torch.equal(got, reference.reference_lut_linear(a.cpu(), w.cpu(), lut.cpu()))


@pytest.mark.parametrize("backend,device", [("python", "cpu"), *backend_params()])
def test_empty_batch(backend, device):
    lut = exact_lut(True)
    a, w, lut = to(device, torch.zeros((0, 5), dtype=torch.int8), torch.ones((3, 5), dtype=torch.int8), lut)
    assert ops.lut_linear(a, w, lut, backend=backend).shape == (0, 3)
    a = torch.zeros((0, 2, 5, 5), dtype=torch.int8, device=device)
    w = torch.ones((3, 2, 3, 3), dtype=torch.int8, device=device)
    assert ops.lut_conv2d(a, w, lut, backend=backend).shape == (0, 3, 3, 3)


@pytest.mark.skipif(not any(b == "cpp" for b, _ in BACKENDS), reason="runner._C not built")
@pytest.mark.parametrize("lut_kind", list(LUTS))
def test_tiled_edges(gen, lut_kind):
    """cpp tiled's edges, bit-exact: channel tiles of 32 ending in a 24-, 8- or 16-wide one, taps in
    several chunks (a chunk holds 16 taps of int16 products, 8 of int32), groups, depthwise, linear."""
    lut = LUTS[lut_kind](gen)
    for signed in (True, False):
        for ashape, n, k, stride, padding, groups in [((2, 4, 9, 9), 88, 3, 1, 1, 1), ((1, 6, 7, 5), 80, 3, 2, 1, 2),
                                                      ((2, 6, 5, 5), 48, 1, 1, 0, 3), ((2, 5, 6, 6), 5, 3, 1, 1, 5)]:
            a, w = codes(gen, ashape, signed), weights(gen, (n, ashape[1] // groups, k, k))
            want = reference.reference_lut_conv2d(a, w, lut, stride, padding, 1, groups)
            got = ops.lut_conv2d(a, w, lut, stride, padding, 1, groups, algo="tiled")
            assert torch.equal(got, want), (signed, ashape, n, groups)
        a, w = codes(gen, (9, 40), signed), weights(gen, (56, 40))
        assert torch.equal(ops.lut_linear(a, w, lut, algo="tiled"), reference.reference_lut_linear(a, w, lut))


def edge16_lut(gen):
    """An int16 table whose columns hold -32768 (the one int16 whose negation is not one): for unsigned
    codes a negative weight's product is +32768, so those columns need the int32 format."""
    lut = random_lut(gen, -(2**15), 2**15)
    lut[torch.randint(0, 256, (64,), generator=gen), ::2] = -(2**15)
    return lut


@pytest.mark.skipif(not any(b == "cpp" for b, _ in BACKENDS), reason="runner._C not built")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lut_kind", ["lut16", "lut32", "edge16"])
def test_tiled_threads_and_formats(gen, threads, lut_kind):
    """cpp tiled forced, bit-exact, on 1 and 2 threads (the second thread's first tile is not the call's
    first): channels per group not a multiple of 32 (40: a 32- and an 8-wide tile; 20, 72, 100), taps
    not a multiple of 16 or 8 (27, 75: a partial last chunk in both formats), groups whose rows are not
    a multiple of 8, rows few (3, 9) and many (338 a group: tiles built for the codes their rows read, blocks of 8
    codes of which a few or most are read; 2100 rows: every code built), a depthwise conv of 64 groups x 4418 rows
    (its row pointers filled by several tasks), int16 products, int32 ones, and -32768 in the table (its negation,
    for unsigned codes and negative weights, needs int32)."""
    lut = edge16_lut(gen) if lut_kind == "edge16" else LUTS[lut_kind](gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for signed in (True, False):
            for ashape, n, k, stride, padding, groups in [((2, 6, 9, 9), 80, 3, 1, 0, 2),
                                                          ((2, 6, 13, 13), 40, 3, 1, 1, 2),
                                                          ((1, 3, 5, 5), 72, 5, 2, 2, 1),
                                                          ((2, 64, 47, 47), 64, 3, 1, 1, 64)]:
                a, w = codes(gen, ashape, signed), weights(gen, (n, ashape[1] // groups, k, k))
                want = reference.reference_lut_conv2d(a, w, lut, stride, padding, 1, groups)
                got = ops.lut_conv2d(a, w, lut, stride, padding, 1, groups, algo="tiled")
                assert torch.equal(got, want), (signed, ashape, n, groups)
            for m, k, n in [(3, 27, 40), (200, 75, 100), (2100, 20, 48)]:
                a, w = codes(gen, (m, k), signed), weights(gen, (n, k))
                got = ops.lut_linear(a, w, lut, algo="tiled")
                assert torch.equal(got, reference.reference_lut_linear(a, w, lut)), (signed, m, k, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not any(b == "cpp" for b, _ in BACKENDS), reason="runner._C not built")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lut_kind", ["lut16", "lut32", "edge16"])
def test_tiled_gathers_one_channel_groups_by_pixels(gen, threads, lut_kind):
    """cpp tiled on calls of one output channel a group and <= 64 taps (depthwise convs) computes a group's output
    pixels 8 a vector, a tap's 8 codes loaded at once where the row stride is 1 or 2: rows of 8 and a tail (21, 17
    outputs), stride 2 (even codes picked from two loads), strides 3 and (1, 3) and dilation (a code at a time), 2 input
    channels a group (K = 18), 5x5 taps, no padding with the last load ending at the input's last byte, a linear layer
    of one output; and a one-channel conv of 72 taps, which keeps the channel tiles."""
    lut = edge16_lut(gen) if lut_kind == "edge16" else LUTS[lut_kind](gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for signed in (True, False):
            for ashape, n, k, stride, padding, dilation, groups in [
                    ((2, 16, 21, 21), 16, 3, 1, 1, 1, 16), ((2, 8, 24, 33), 8, 3, 2, 1, 1, 8),
                    ((1, 6, 26, 29), 6, 3, 3, 1, 1, 6), ((2, 4, 13, 30), 4, 3, (1, 3), 0, 2, 4),
                    ((2, 12, 18, 18), 6, 3, 1, 1, 1, 6), ((1, 5, 20, 20), 5, 5, 2, 2, 1, 5),
                    ((3, 7, 10, 18), 7, 3, 1, 0, 1, 7), ((2, 8, 9, 9), 1, 3, 1, 1, 1, 1)]:
                a, w = codes(gen, ashape, signed), weights(gen, (n, ashape[1] // groups, k, k))
                want = reference.reference_lut_conv2d(a, w, lut, stride, padding, dilation, groups)
                for algo in ("tiled", "auto"):
                    got = ops.lut_conv2d(a, w, lut, stride, padding, dilation, groups, algo=algo)
                    assert torch.equal(got, want), (signed, ashape, stride, groups, algo)
            a, w = codes(gen, (50, 40), signed), weights(gen, (1, 40))
            assert torch.equal(ops.lut_linear(a, w, lut, algo="tiled"), reference.reference_lut_linear(a, w, lut))
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not any(b == "cpp" for b, _ in BACKENDS), reason="runner._C not built")
@pytest.mark.parametrize("isa", ["avx2", "base"])
def test_cpu_isa_variants(isa):
    """The narrower instruction-set variants (chosen on older CPUs) compute the same sums."""
    code = (
        "import torch\n"
        "from runner import ops, reference\n"
        "from tests.ops.conftest import codes, random_lut, weights\n"
        "g = torch.Generator().manual_seed(3)\n"
        "for signed in (True, False):\n"
        "    for lk in ((-2**15 + 1, 2**15), (-2**30, 2**30)):\n"
        "        lut = random_lut(g, *lk)\n"
        "        for ashape, wshape, groups in (((3, 6, 12, 12), (20, 3, 5, 5), 2), ((2, 4, 6, 6), (88, 4, 3, 3), 1),\n"
        "                                       ((2, 8, 19, 19), (8, 1, 3, 3), 8)):\n"
        "            a, w = codes(g, ashape, signed), weights(g, wshape)\n"
        "            want = reference.reference_lut_conv2d(a, w, lut, 1, 2, 1, groups)\n"
        "            for algo in ('direct', 'expanded', 'tiled'):\n"
        "                got = ops.lut_conv2d(a, w, lut, 1, 2, 1, groups, algo=algo)\n"
        "                assert torch.equal(got, want), (signed, lk, algo)\n"
        "print('ok')\n"
    )
    assert_prints_ok(code, APPROX_RUN_CPU_ISA=isa)


def test_python_backend_and_errors(gen):
    lut = random_lut(gen)
    a, w = codes(gen, (4, 8), True), weights(gen, (3, 8))
    assert torch.equal(ops.lut_linear(a, w, lut, backend="python"), reference.reference_lut_linear(a, w, lut))
    with pytest.raises(UserError, match="unknown backend"):
        ops.lut_linear(a, w, lut, backend="fortran")
    if any(b == "cpp" for b, _ in BACKENDS):
        with pytest.raises(UserError, match="cuda"):
            ops.lut_linear(a, w, lut, backend="cuda")


def test_without_extension():
    """Without runner._C, importing runner.ops works, python runs, cpp says how to build."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'runner._C':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from runner import ops\n"
        "from runner.errors import UserError\n"
        "a = torch.zeros((2, 3), dtype=torch.int8); w = torch.ones((4, 3), dtype=torch.int8)\n"
        "lut = torch.ones((256, 256), dtype=torch.int32)\n"
        "assert ops.lut_linear(a, w, lut, backend='python').eq(3).all()\n"
        "try:\n"
        "    ops.lut_linear(a, w, lut, backend='cpp')\n"
        "except UserError as e:\n"
        "    assert 'pip install' in str(e), e\n"
        "    print('ok')\n"
    )
    assert_prints_ok(code)
