"""CUDA kernels of approx::lut_linear / approx::lut_conv2d: bit-exact against the python reference
and the CPU kernel, every output element written, grid limits, input checks.

Marked `cuda` (deselected by default; run with `-m cuda` on a GPU machine). Imports nothing from
runner.cli or the Hydra configs, so it runs where hydra is not installed.
"""
import gc
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda

POISON = -0x21524111  # 0xDEADBEEF as int32


def _cuda_ready():
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from runner import _ext
    except ImportError as exc:  # pragma: no cover
        return f"runner not importable: {exc}"
    if not _ext.has_kernel("lut_linear", "CUDA"):
        return "runner._C has no CUDA kernels"
    return None


_why = _cuda_ready()
if _why:
    pytest.skip(_why, allow_module_level=True)

from runner import _ext  # noqa: E402
from runner.bench import LENET5_LAYERS  # noqa: E402
from runner.ops import algo_table, backend_algos  # noqa: E402
from runner.reference import reference_lut_conv2d, reference_lut_linear  # noqa: E402

ops = torch.ops.approx
DEV = torch.device("cuda")
ALGOS = ["direct", "expanded", "expanded_l2", "auto"]
if os.environ.get("APPROX_TEST_SKIP_AUTO") == "1":  # to test the rest when auto is broken
    ALGOS.remove("auto")
NO_CACHING = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"


def _pair(v):
    """A conv argument (stride, padding, dilation), an int or a pair, as the ops take it: a list of two."""
    return [v, v] if isinstance(v, int) else list(v)


def extra_algos(a, w, lut, *conv_args):
    """The variants with shape limits that run this call's shapes, as the kernels' own algorithm
    table says (approx::lut_algos): so a variant can never silently drop out of these tests."""
    rows = algo_table(a, w, lut, *conv_args, backend="cuda")
    return [r["algo"] for r in rows if r["applies"] and r["algo"] not in ALGOS]


EXERCISED = set()  # every variant some shape of the tests below ran (test_every_variant_is_exercised)


def _has_cpu():
    return _ext.has_kernel("lut_linear", "CPU")


def make_lut(gen, kind):
    """kind: 'int16' (every product fits int16, lut[0][0] != 0), 'wide' (full int32 range: the
    int32 paths and wrap-around), 'exact' (true products)."""
    if kind == "int16":
        lut = torch.randint(-16000, 16000, (256, 256), generator=gen, dtype=torch.int32)
        lut[0, 0] = 12345
        lut[128, 128] = -777
        return lut
    if kind == "wide":
        return torch.randint(-2**31, 2**31 - 1, (256, 256), generator=gen, dtype=torch.int64).to(
            torch.int32)
    raise ValueError(kind)


def make_codes(gen, shape, signed):
    if signed:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def make_weights(gen, shape, signed):
    # sign-magnitude weights of unsigned multipliers are -127..127
    lo = -128 if signed else -127
    return torch.randint(lo, 128, shape, generator=gen, dtype=torch.int8)


def poisoned_call(fn, out_shape):
    """Calls fn() after filling a freed block of the output's size with POISON, so that the op's
    output (allocated first, same size, same stream) starts as poison: unwritten elements show."""
    if not NO_CACHING:
        p = torch.full(out_shape, POISON, dtype=torch.int32, device=DEV)
        del p
    return fn()


def check_equal(got, want, what):
    got = got.cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} of {want.numel()} elements differ; first at "
                             f"{i}: got {got[i].item()}, want {want[i].item()}"
                             + (" (poison: never written)" if got[i].item() == POISON else ""))


LINEAR_SHAPES = [
    (1, 1, 1),
    (7, 13, 5),
    (300, 150, 16),
    (1000, 256, 120),
    (513, 84, 10),
    (64, 37, 300),    # N above 128 and above 32 groups of 8 (grid.z)
    (33, 1000, 8),
    (2500, 120, 84),
    (129, 9, 17),
    # expanded_gemm: ViT's qkv width at few rows, over the expanded tables' budget
    (37, 768, 2304),
    (1100, 130, 45),
]


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("lutkind", ["int16", "wide"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_matches_reference(shape, lutkind, signed):
    m, k, n = shape
    gen = torch.Generator().manual_seed(hash((shape, lutkind, signed)) & 0xFFFF)
    a = make_codes(gen, (m, k), signed)
    w = make_weights(gen, (n, k), signed)
    lut = make_lut(gen, lutkind)
    want = reference_lut_linear(a, w, lut)
    if _has_cpu():
        check_equal(ops.lut_linear(a, w, lut, "direct"), want, "CPU kernel vs reference")
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    # a table-reading variant forced on a shape over the table budget (ViT's qkv: 768 x 256 x 2304 entries,
    # 1.7 GiB as int32) declines with the budget in its message instead of running
    over_budget = [r["algo"] for r in algo_table(ad, wd, ld, backend="cuda")
                   if r["algo"] in ALGOS and not r["applies"] and "budget" in r["note"]]
    if over_budget:
        over_budget.append("expanded")  # the first table variant that runs the shape, once the budget allows
    for algo in over_budget:
        with pytest.raises(RuntimeError, match="budget"):
            ops.lut_linear(ad, wd, ld, algo)
    algos = [x for x in ALGOS if x not in over_budget] + extra_algos(ad, wd, ld)
    EXERCISED.update(algos)
    for algo in algos:
        got = poisoned_call(lambda: ops.lut_linear(ad, wd, ld, algo), (m, n))
        check_equal(got, want, f"lut_linear {shape} {lutkind} signed={signed} algo={algo}")


CONV_CASES = [
    # (B, C, H, W), (N, kh, kw), stride, padding, dilation, groups
    ((1, 1, 28, 28), (6, 5, 5), 1, 0, 1, 1),         # conv1, batch 1
    ((3, 6, 12, 12), (16, 5, 5), 1, 0, 1, 1),        # conv2
    ((2, 3, 11, 9), (8, 3, 3), 2, 1, 1, 1),
    ((2, 4, 10, 13), (6, 3, 2), (1, 2), (2, 1), (2, 1), 2),
    ((1, 6, 9, 9), (9, 3, 3), 1, 1, 2, 3),
    ((2, 8, 7, 7), (8, 3, 3), 1, 1, 1, 8),           # depthwise
    ((2, 5, 6, 6), (40, 1, 1), 1, 0, 1, 1),          # 1x1, N > 32
    ((1, 2, 5, 5), (3, 5, 5), 1, 2, 1, 1),           # mostly padding
    ((2, 4, 17, 15), (150, 3, 3), 3, 2, 2, 2),       # N above 128 (75 per group)
    # expanded_window shapes (stride 1, dilation 1, kw 3 or 5)
    ((5, 3, 9, 11), (20, 3, 5), 1, (1, 2), 1, 1),    # kh != kw, Wo 11: a 3-wide tail segment
    ((40, 2, 4, 6), (12, 3, 3), 1, 0, 1, 2),         # 2x4 outputs: a tile spans 33 images
    ((2, 1, 40, 70), (8, 5, 5), 1, 2, 1, 1),         # 70 outputs a row: tiles inside one image
    ((3, 4, 6, 6), (4, 3, 3), 1, 1, 1, 4),           # depthwise, padding, Wo 6 (unaligned rows)
    # depthwise variant shapes: 5x5 at stride 2 and dilation 2; uneven stride and padding over many
    # blocks a channel; 7x7 (49 taps: the most it takes, over 48 KiB of shared memory)
    ((2, 6, 11, 9), (6, 5, 5), 2, 2, 2, 6),
    ((5, 3, 40, 37), (3, 3, 3), (2, 1), (1, 0), 1, 3),
    ((1, 2, 9, 9), (2, 7, 7), 1, 3, 1, 2),
    ((2, 8, 9, 9), (8, 3, 3), 2, 1, 1, 8),           # depthwise 3x3 at stride 2 (its split table)
    # expanded_gemm (1x1, one group): ResNet-50's 1024 -> 256; stride 2 with padding, odd sizes
    ((2, 1024, 5, 5), (256, 1, 1), 1, 0, 1, 1),
    ((3, 21, 9, 7), (37, 1, 1), 2, 1, 1, 1),
]


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("lutkind", ["int16", "wide"])
@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_conv_matches_reference(case, lutkind, signed):
    (b, c, h, wd_), (n, kh, kw), stride, padding, dilation, groups = CONV_CASES[case]
    gen = torch.Generator().manual_seed(1000 + case * 4 + (lutkind == "wide") * 2 + signed)
    a = make_codes(gen, (b, c, h, wd_), signed)
    w = make_weights(gen, (n, c // groups, kh, kw), signed)
    lut = make_lut(gen, lutkind)
    want = reference_lut_conv2d(a, w, lut, stride, padding, dilation, groups)
    args = (_pair(stride), _pair(padding), _pair(dilation), groups)
    if _has_cpu():
        check_equal(ops.lut_conv2d(a, w, lut, *args, "direct"), want, "CPU kernel vs reference")
    ad, wdv, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    algos = ALGOS + extra_algos(ad, wdv, ld, *args)
    EXERCISED.update(algos)
    for algo in algos:
        got = poisoned_call(lambda: ops.lut_conv2d(ad, wdv, ld, *args, algo), tuple(want.shape))
        check_equal(got, want, f"lut_conv2d case {case} {lutkind} signed={signed} algo={algo}")


@pytest.mark.parametrize("lutkind", ["int16", "wide"])
@pytest.mark.parametrize("shape", [(3000, 256, 120), (700, 84, 10), (1100, 37, 17), (300, 1001, 9)],
                         ids=lambda s: "x".join(map(str, s)))
def test_every_rows_configuration(shape, lutkind):
    """auto times every expanded_rows configuration (rows per thread x cluster size) and keeps
    the fastest, so each must be exact, not only the default one. 300x1001: 126 (int16) or 251
    (int32) chunks through 2-3 slots, so every slot's barriers go through many phases while the
    summing warps of a short tile run ahead of each other."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(hash((shape, lutkind)) & 0xFFFF)
    a, w, lut = make_codes(gen, (m, k), True), make_weights(gen, (n, k), True), make_lut(gen, lutkind)
    want = reference_lut_linear(a, w, lut)
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    # clusters split the taps' chunks (8 int16 or 4 int32 taps): no more blocks than chunks
    chunks = (k + 7) // 8 * 8 // (8 if lutkind == "int16" else 4)
    major = torch.cuda.get_device_capability()[0]
    configs = [(r, cs, "") for r in (1, 2, 3, 4) for cs in (1, 2, 3, 8)]
    configs += [(r, cs, "_t512") for r in (2, 4) for cs in (1, 2)]
    # shorter row tiles than threads x R (balanced waves): the tail rows of each block idle
    configs += [(2, 1, "_m100"), (4, 2, "_t512_m333"), (1, 1, "_m1"), (3, 8, "_m700")]
    for r, cs, th in configs:
        algo = f"expanded_rows_r{r}_c{cs}{th}"
        if cs > 1 and (major < 9 or cs > chunks):
            with pytest.raises(RuntimeError, match="cluster"):
                ops.lut_linear(ad, wd, ld, algo)
            continue
        got = poisoned_call(lambda: ops.lut_linear(ad, wd, ld, algo), (m, n))
        check_equal(got, want, f"{shape} {lutkind} {algo}")
    with pytest.raises(RuntimeError, match="bad algo"):
        ops.lut_linear(ad, wd, ld, "expanded_rows_r5_c1")
    for bad in ("expanded_rows_r1_c1_t512", "expanded_rows_r2_c1_m513", "expanded_rows_r2_c1_m0",
                "expanded_rows_r2_c1_mx"):
        with pytest.raises(RuntimeError, match="bad algo"):
            ops.lut_linear(ad, wd, ld, bad)


def _shape_tests_variants():
    """The variants the shape tests run on their shape lists, as the kernels' table says: under pytest -n those tests
    may run in other processes, so their EXERCISED sets are not all here."""
    from tests.ops.test_cuda_depthwise import CASES as DEPTHWISE
    gen = torch.Generator().manual_seed(0)
    calls = [((m, k), (n, k), ()) for m, k, n in LINEAR_SHAPES]
    calls += [(a, (n, a[1] // g, kh, kw), (_pair(s), _pair(p), _pair(d), g))
              for a, (n, kh, kw), s, p, d, g in CONV_CASES]
    calls += [(a, (a[1], 1, 3, 3), (_pair(s), _pair(p), [1, 1], a[1])) for a, s, p in DEPTHWISE.values()]
    out = set(ALGOS)
    for kind in ("int16", "wide"):
        ld = make_lut(gen, kind).to(DEV)
        for signed in (True, False):
            for a, w, conv in calls:
                out.update(extra_algos(make_codes(gen, a, signed).to(DEV), make_weights(gen, w, signed).to(DEV), ld,
                                       *conv))
    return out


def test_every_variant_is_exercised():
    """The shape tests (linear, conv, depthwise) run every variant of the kernels' table at least once: what their
    shape lists take, and, where the linear and conv ones ran before it in this process (pytest keeps file order; not
    under pytest -n), what they ran."""
    want, taken = set(backend_algos("cuda")), _shape_tests_variants()
    assert want <= taken, want - taken
    if EXERCISED and not os.environ.get("PYTEST_XDIST_WORKER"):
        assert want <= EXERCISED, want - EXERCISED


def alloc_blocks(nbytes):
    """Bytes the caching allocator takes for nbytes: whole 512-byte blocks."""
    return -(-nbytes // 512) * 512


def kept_by_first_call(call, call_on_other_weights):
    """Device memory a layer's first call leaves allocated beyond its int32 output (its prepared tables), and the
    output. Earlier tests' tensors are freed first, and a call on other weights (the caller keeps them alive, so their
    cached entry stays) drops the entries before it, so that nothing else is freed during the measured call."""
    gc.collect()
    call_on_other_weights()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before - alloc_blocks(out.numel() * 4), out


@pytest.mark.parametrize("algo", ["direct", "expanded_rows", "expanded_pairs", "expanded_l2", "expanded_gemm"])
def test_workspace_is_what_the_kernels_allocate(algo):
    """approx::lut_algos' workspace_bytes (what bench reports) is the device memory a layer's first
    call keeps allocated for its prepared tables (fc3's shape: every table kind, pairs included)."""
    gen = torch.Generator().manual_seed(11)
    a = make_codes(gen, (300, 84), False).to(DEV)
    w, lut = make_weights(gen, (10, 84), False).to(DEV), make_lut(gen, "int16").to(DEV)
    want = {r["algo"]: r["workspace_bytes"] for r in algo_table(a, w, lut, backend="cuda")}[algo]
    if NO_CACHING:
        pytest.skip("caching allocator off (compute-sanitizer runs): memory_allocated does not count as it does")
    w_other = w.clone()
    kept, _ = kept_by_first_call(lambda: ops.lut_linear(a, w, lut, algo), lambda: ops.lut_linear(a, w_other, lut, algo))
    assert kept == alloc_blocks(want), (algo, kept, want)


def test_auto_keeps_only_the_tables_its_pick_reads():
    """auto's first call builds the weight-expanded table T where it fits (its trial times the T variants);
    once it has picked a variant that does not read T, the cached entry keeps E only. Kept whole, ResNet-50's
    T tables (up to 600 MiB a layer) overflowed the cache together and every forward rebuilt them. Later calls,
    an explicit T variant after them, and a graph replay still give the reference sums."""
    gen = torch.Generator().manual_seed(14)
    a = make_codes(gen, (16, 256, 28, 28), False).to(DEV)  # 12,544 rows; T of 128 MiB (int32 layout)
    w, lut = make_weights(gen, (512, 256, 1, 1), False).to(DEV), make_lut(gen, "int16").to(DEV)
    args = ([1, 1], [0, 0], [1, 1], 1)
    w_other = w.clone()
    kept, out = kept_by_first_call(lambda: ops.lut_conv2d(a, w, lut, *args, "auto"),
                                   lambda: ops.lut_conv2d(a, w_other, lut, *args, "direct"))
    pick = next(r for r in algo_table(a, w, lut, *args, backend="cuda") if r["auto_pick"])
    assert kept == alloc_blocks(pick["workspace_bytes"]), (pick["auto_pick_name"], kept, pick["workspace_bytes"])
    want = reference_lut_conv2d(a.cpu(), w.cpu(), lut.cpu(), 1, 0, 1, 1)
    check_equal(out, want, "auto's first call")
    check_equal(ops.lut_conv2d(a, w, lut, *args, "auto"), want, "auto on the kept tables")
    check_equal(ops.lut_conv2d(a, w, lut, *args, "expanded"), want, "a T variant after auto")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = ops.lut_conv2d(a, w, lut, *args, "auto")
    g.replay()
    check_equal(replayed, want, "graph replay")
    if pick["algo"] in ("expanded_l2", "expanded_smem", "expanded_window", "expanded_rows", "expanded_pairs"):
        pytest.skip(f"auto picked {pick['auto_pick_name']}, which reads T: nothing to drop on this device")


_REFUSAL_CHILD = """
import torch
from runner import ops
from runner.ops import algo_table
from runner.reference import reference_lut_linear
gen = torch.Generator().manual_seed(15)
lut = torch.randint(-16000, 16000, (256, 256), generator=gen, dtype=torch.int32).cuda()
a = torch.randint(0, 256, (64, 512), generator=gen, dtype=torch.uint8).cuda()
w1, w2 = (torch.randint(-127, 128, (256, 512), generator=gen, dtype=torch.int8).cuda() for _ in range(2))
def kept(w, algo):  # device memory a call leaves allocated, its output aside
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = ops.lut_linear(a, w, lut, backend="cuda", algo=algo)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), reference_lut_linear(a.cpu(), w.cpu(), lut.cpu())), algo
    return torch.cuda.memory_allocated() - before - out.numel() * 4
pick = lambda w: next(r for r in algo_table(a, w, lut, backend="cuda") if r["auto_pick"])["algo"]
print(kept(w1, "expanded_l2"), kept(w2, "expanded_l2"), kept(w1, "expanded_l2"), kept(w2, "auto"), pick(w2))
"""


def test_table_cache_keeps_e_only_where_t_has_no_room(tmp_path):
    """A T the cache has no room for is not cached, and no other layer's is evicted for it: the layer's entry
    keeps E, and auto picks without T for it. Here (APPROX_RUN_TABLE_CACHE_MB=200, T of 128 MiB a layer) the first
    layer keeps its T, the second keeps E only, a repeated call adds nothing, every call gives the reference sums.
    An LRU evicted every table of a forward cycling through more T than the cache held (ViT-B/16's attention
    projections), and each forward rebuilt them."""
    script = tmp_path / "child.py"
    script.write_text(_REFUSAL_CHILD)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "APPROX_RUN_TABLE_CACHE_MB": "200", "PYTHONPATH": root}
    run = subprocess.run([sys.executable, str(script)], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    first, second, again, auto, pick = run.stdout.split()
    assert int(first) >= 128 << 20 and int(second) < 4 << 20, (first, second)
    assert int(again) == 0 and int(auto) == 0, (again, auto)
    assert pick not in ("expanded_l2", "expanded_smem", "expanded_window", "expanded_rows", "expanded_pairs"), pick


@pytest.mark.parametrize("value", ["200MB", "0", "-5", ""])
def test_table_cache_size_that_is_not_a_number_is_an_error(tmp_path, value):
    """APPROX_RUN_TABLE_CACHE_MB must be a size in MiB: a typo reported on every call, not a 1 MiB cache that
    refuses every T and leaves auto on its slower picks without a word."""
    script = tmp_path / "child.py"
    script.write_text(_REFUSAL_CHILD)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "APPROX_RUN_TABLE_CACHE_MB": value, "PYTHONPATH": root}
    run = subprocess.run([sys.executable, str(script)], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and f"APPROX_RUN_TABLE_CACHE_MB='{value}'" in run.stderr, run.stderr[-3000:]


def test_auto_pick_is_reported():
    # K = 122, not a multiple of 4: auto runs the layer as given, not as a 1x1 conv over its transposed codes, whose
    # pick test_cuda_gemm.py's test_auto_runs_linear_layers_transposed checks
    gen = torch.Generator().manual_seed(12)
    a = make_codes(gen, (5000, 122), False).to(DEV)
    w, lut = make_weights(gen, (84, 122), False).to(DEV), make_lut(gen, "int16").to(DEV)
    ops.lut_linear(a, w, lut, "auto")
    picks = [r for r in algo_table(a, w, lut, backend="cuda") if r["auto_pick"]]
    assert len(picks) == 1 and picks[0]["applies"] and picks[0]["auto_pick_name"].startswith(picks[0]["algo"])
    # the reported pick runs as an explicit algo and gives the same sums
    check_equal(ops.lut_linear(a, w, lut, picks[0]["auto_pick_name"]), ops.lut_linear(a, w, lut, "direct").cpu(),
                "auto's reported pick")


def _reported_pick(a, w, lut, *conv_args):
    return next((r["auto_pick_name"] for r in algo_table(a, w, lut, *conv_args, backend="cuda") if r["auto_pick"]),
                "")


def test_auto_pick_cache_keys_on_table_format_kernel_size_and_dilation():
    """auto's pick is cached per everything its candidates depend on: a call that differs from an
    already picked one only in its table format (int16 or int32 products), or in kernel size and
    dilation (same taps, output size and padding), has no pick yet (lut_algos reports none) and is
    timed on its first call; its output is still exact."""
    gen = torch.Generator().manual_seed(26)
    lut16, lut32 = make_lut(gen, "int16"), make_lut(gen, "wide")
    a, w = make_codes(gen, (3000, 72), False), make_weights(gen, (24, 72), False)
    ad, wd, l16, l32 = a.to(DEV), w.to(DEV), lut16.to(DEV), lut32.to(DEV)
    ops.lut_linear(ad, wd, l16, "auto")
    assert _reported_pick(ad, wd, l16) != ""
    assert _reported_pick(ad, wd, l32) == ""  # keyed on the table format too
    check_equal(ops.lut_linear(ad, wd, l32, "auto"), reference_lut_linear(a, w, lut32), "auto, int32 table")
    assert _reported_pick(ad, wd, l32) != ""

    # (5, 3) taps dilated (1, 2) and (3, 5) taps dilated (2, 1): both span 5 x 5, K = 2 * 15
    a = make_codes(gen, (8, 2, 16, 16), True)
    w53, w35 = make_weights(gen, (8, 2, 5, 3), True), make_weights(gen, (8, 2, 3, 5), True)
    ad, w53d, w35d = a.to(DEV), w53.to(DEV), w35.to(DEV)
    ops.lut_conv2d(ad, w53d, l16, [1, 1], [0, 0], [1, 2], 1, "auto")
    assert _reported_pick(ad, w53d, l16, 1, 0, (1, 2)) != ""
    assert _reported_pick(ad, w35d, l16, 1, 0, (2, 1)) == ""  # keyed on kernel size and dilation
    check_equal(ops.lut_conv2d(ad, w35d, l16, [1, 1], [0, 0], [2, 1], 1, "auto"),
                reference_lut_conv2d(a, w35, lut16, 1, 0, (2, 1)), "auto, (3, 5) dilated (2, 1)")
    assert _reported_pick(ad, w35d, l16, 1, 0, (2, 1)) != ""


def test_poison_reaches_output():
    if NO_CACHING:
        pytest.skip("caching allocator off: the poisoning trick does not apply")
    a = torch.zeros((100, 16), dtype=torch.int8, device=DEV)
    w = torch.zeros((7, 16), dtype=torch.int8, device=DEV)
    lut = torch.zeros((256, 256), dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    p = torch.full((100, 7), POISON, dtype=torch.int32, device=DEV)
    ptr = p.data_ptr()
    del p
    out = ops.lut_linear(a, w, lut, "direct")
    assert out.data_ptr() == ptr, "the output did not reuse the poisoned block"
    assert int(out.abs().max()) == 0


# LeNet-5 layers at batch 10,000 against the CPU kernel (the reference on a slice).
# LeNet-5's layers (runner.bench.LENET5_LAYERS) at batch 10,000
LENET = {name: (kind, (10000, *ashape), wshape) for name, kind, ashape, wshape in LENET5_LAYERS}


@pytest.mark.parametrize("signed", [True, False], ids=["s", "u"])
@pytest.mark.parametrize("layer", list(LENET))
def test_lenet_batch10000(layer, signed):
    kind, ashape, wshape = LENET[layer]
    gen = torch.Generator().manual_seed(7 + signed)
    a = make_codes(gen, ashape, signed)
    if not signed:  # ReLU-like: half zeros
        a[torch.rand(ashape, generator=gen) < 0.5] = 0
    w = make_weights(gen, wshape, signed)
    lut = make_lut(gen, "int16")
    op = ops.lut_conv2d if kind == "conv" else ops.lut_linear
    extra = ([1, 1], [0, 0], [1, 1], 1) if kind == "conv" else ()
    ref_fn = reference_lut_conv2d if kind == "conv" else reference_lut_linear
    want_head = ref_fn(a[:50], w, lut)
    want = op(a, w, lut, *extra, "auto") if _has_cpu() else None
    if want is not None:
        check_equal(want[:50], want_head, f"{layer}: CPU kernel vs reference")
    ad, wd, ld = a.to(DEV), w.to(DEV), lut.to(DEV)
    out_shape = (ashape[0],) + tuple(want_head.shape[1:])
    algos = ALGOS + extra_algos(ad, wd, ld, *extra)
    for algo in algos:
        got = poisoned_call(lambda: op(ad, wd, ld, *extra, algo), out_shape)
        check_equal(got[:50], want_head, f"{layer} algo={algo} vs reference (first 50)")
        if want is not None:
            check_equal(got, want, f"{layer} algo={algo} vs CPU kernel")


@pytest.mark.parametrize("algo", ["direct", "expanded_smem", "expanded_l2", "expanded_rows"])
def test_rows_beyond_grid_y_limit(algo):
    """More rows than 65,535 x the largest tile height (2,048 rows): the row tiles run on grid.x."""
    m = 65535 * 2048 + 123
    gen = torch.Generator().manual_seed(3)
    lut = make_lut(gen, "int16").to(DEV)
    a = torch.randint(-128, 128, (m, 1), dtype=torch.int8, device=DEV)
    w = torch.tensor([[-77]], dtype=torch.int8, device=DEV)
    want = lut.reshape(-1)[(a[:, 0].long() + 128) * 256 + (-77 + 128)].reshape(m, 1)
    got = poisoned_call(lambda: ops.lut_linear(a, w, lut, algo), (m, 1))
    assert torch.equal(got, want), f"{int((got != want).sum())} rows differ"
    del got, want
    if algo == "expanded_rows":
        return
    # The same through conv rows: 1x1 conv over B*H*W > the limit.
    x = torch.randint(-128, 128, (2049, 1, 256, 256), dtype=torch.int8, device=DEV)
    wc = w.reshape(1, 1, 1, 1)
    want = lut.reshape(-1)[(x.long() + 128) * 256 + (-77 + 128)]
    got = poisoned_call(lambda: ops.lut_conv2d(x, wc, lut, [1, 1], [0, 0], [1, 1], 1, algo),
                        tuple(want.shape))
    assert torch.equal(got, want), f"{int((got != want).sum())} conv rows differ"


def test_auto_is_cached_and_deterministic():
    gen = torch.Generator().manual_seed(11)
    a = make_codes(gen, (4000, 64), True).to(DEV)
    w = make_weights(gen, (24, 64), True).to(DEV)
    lut = make_lut(gen, "int16").to(DEV)
    r1 = ops.lut_linear(a, w, lut, "auto")   # timed trial
    r2 = ops.lut_linear(a, w, lut, "auto")   # cached choice
    assert torch.equal(r1, r2)
    assert torch.equal(r1.cpu(), reference_lut_linear(a.cpu(), w.cpu(), lut.cpu()))


def test_runs_on_current_stream():
    gen = torch.Generator().manual_seed(12)
    a = make_codes(gen, (3000, 150), False).to(DEV)
    w = make_weights(gen, (16, 150), False).to(DEV)
    lut = make_lut(gen, "int16").to(DEV)
    want = reference_lut_linear(a.cpu(), w.cpu(), lut.cpu())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        outs = [ops.lut_linear(a, w, lut, algo) for algo in ALGOS]
    s.synchronize()
    for o in outs:
        check_equal(o, want, "side stream")


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_table_cache_follows_weight_and_lut_changes(kind):
    """Prepared tables are cached per (weights, LUT) tensor: in-place writes, a freed tensor whose
    memory is reused, and another stream must all see the right table."""
    gen = torch.Generator().manual_seed(21)
    if kind == "linear":
        a = make_codes(gen, (3000, 64), False).to(DEV)
        wshape = (24, 64)
        call = lambda w, lut, algo: ops.lut_linear(a, w, lut, algo)  # noqa: E731
        ref = lambda w, lut: reference_lut_linear(a.cpu(), w.cpu(), lut.cpu())  # noqa: E731
    else:
        a = make_codes(gen, (20, 3, 12, 12), False).to(DEV)
        wshape = (16, 3, 5, 5)
        args = ([1, 1], [1, 1], [1, 1], 1)
        call = lambda w, lut, algo: ops.lut_conv2d(a, w, lut, *args, algo)  # noqa: E731
        ref = lambda w, lut: reference_lut_conv2d(a.cpu(), w.cpu(), lut.cpu(), 1, 1, 1, 1)  # noqa: E731
    w = make_weights(gen, wshape, False).to(DEV)
    lut = make_lut(gen, "int16").to(DEV)
    for algo in ("expanded", "auto", "direct"):
        check_equal(call(w, lut, algo), ref(w, lut), f"{algo} first call")
        w[0].neg_()                        # in place: bumps the version counter
        check_equal(call(w, lut, algo), ref(w, lut), f"{algo} after an in-place weight write")
        lut[3:7] += 5
        check_equal(call(w, lut, algo), ref(w, lut), f"{algo} after an in-place LUT write")
    # Free the weights and allocate new ones of the same size: likely the same address.
    ptr = w.data_ptr()
    del w
    w2 = make_weights(gen, wshape, False).to(DEV)
    check_equal(call(w2, lut, "expanded"), ref(w2, lut), f"reallocated weights (same address: "
                f"{w2.data_ptr() == ptr})")
    # A table built on the default stream, used on a side stream (and the other way round).
    w3 = make_weights(gen, wshape, False).to(DEV)
    first = call(w3, lut, "expanded")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side = call(w3, lut, "expanded")
        w4 = make_weights(gen, wshape, False).to(DEV)
        side4 = call(w4, lut, "expanded")
    torch.cuda.current_stream().wait_stream(s)
    again4 = call(w4, lut, "expanded")
    for got, want, what in ((first, ref(w3, lut), "default"), (side, ref(w3, lut), "side"),
                            (side4, ref(w4, lut), "side-built"), (again4, ref(w4, lut), "reused")):
        check_equal(got, want, f"stream {what}")


def test_cuda_graph_capture():
    gen = torch.Generator().manual_seed(13)
    a = make_codes(gen, (5000, 25), True).to(DEV)
    w = make_weights(gen, (6, 25), True).to(DEV)
    lut = make_lut(gen, "int16").to(DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.lut_linear(a, w, lut, "expanded")  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_e = ops.lut_linear(a, w, lut, "expanded")
        out_a = ops.lut_linear(a, w, lut, "auto")  # first call of this shape inside a capture
    a.copy_(make_codes(gen, (5000, 25), True).to(DEV))
    g.replay()
    torch.cuda.synchronize()
    want = reference_lut_linear(a.cpu(), w.cpu(), lut.cpu())
    check_equal(out_e, want, "graph replay, expanded")
    check_equal(out_a, want, "graph replay, auto")


def test_bad_inputs_raise():
    a = torch.zeros((4, 8), dtype=torch.int8, device=DEV)
    w = torch.zeros((3, 8), dtype=torch.int8, device=DEV)
    lut = torch.zeros((256, 256), dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="unknown algo 'nope'.*direct.*expanded"):
        ops.lut_linear(a, w, lut, "nope")
    with pytest.raises(RuntimeError, match="int8"):
        ops.lut_linear(a.float(), w, lut, "auto")
    with pytest.raises(RuntimeError, match="must be int8"):
        ops.lut_linear(a, w.to(torch.uint8), lut, "auto")
    with pytest.raises(RuntimeError, match=r"\[256, 256\]"):
        ops.lut_linear(a, w, lut[:100], "auto")
    with pytest.raises(RuntimeError, match="int32"):
        ops.lut_linear(a, w, lut.long(), "auto")
    with pytest.raises(RuntimeError, match="K="):
        ops.lut_linear(a, w[:, :5].contiguous(), lut, "auto")
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.lut_linear(torch.zeros((8, 4), dtype=torch.int8, device=DEV).t(), w, lut, "auto")
    with pytest.raises(RuntimeError, match="same device"):
        ops.lut_linear(a, w, lut.cpu(), "auto")
    with pytest.raises(RuntimeError, match="expanded_pairs"):
        ops.lut_linear(a, torch.zeros((17, 8), dtype=torch.int8, device=DEV), lut, "expanded_pairs")
    with pytest.raises(RuntimeError, match="expanded_smem"):
        ops.lut_linear(a, torch.zeros((40, 8), dtype=torch.int8, device=DEV), lut, "expanded_smem")
    x = torch.zeros((1, 4, 6, 6), dtype=torch.uint8, device=DEV)
    wc = torch.zeros((4, 2, 3, 3), dtype=torch.int8, device=DEV)
    with pytest.raises(RuntimeError, match="groups"):
        ops.lut_conv2d(x, wc, lut, [1, 1], [0, 0], [1, 1], 3, "auto")
    with pytest.raises(RuntimeError, match="input channels"):
        ops.lut_conv2d(x, wc, lut, [1, 1], [0, 0], [1, 1], 1, "auto")
    with pytest.raises(RuntimeError, match="stride"):
        ops.lut_conv2d(x, wc, lut, [0, 1], [0, 0], [1, 1], 2, "auto")
    with pytest.raises(RuntimeError, match="empty"):
        ops.lut_conv2d(x, torch.zeros((4, 2, 7, 7), dtype=torch.int8, device=DEV), lut, [1, 1],
                       [0, 0], [1, 1], 2, "auto")
    with pytest.raises(RuntimeError, match="unknown algo"):
        ops.lut_conv2d(x, wc, lut, [1, 1], [0, 0], [1, 1], 2, "fast")


def test_empty_and_k0():
    lut = torch.ones((256, 256), dtype=torch.int32, device=DEV)
    out = ops.lut_linear(torch.zeros((0, 5), dtype=torch.int8, device=DEV),
                         torch.zeros((3, 5), dtype=torch.int8, device=DEV), lut, "auto")
    assert out.shape == (0, 3)
    out = ops.lut_linear(torch.zeros((4, 0), dtype=torch.int8, device=DEV),
                         torch.zeros((3, 0), dtype=torch.int8, device=DEV), lut, "auto")
    assert out.shape == (4, 3) and int(out.abs().sum()) == 0
    # a conv of no input channels, with rows enough for auto's GEMM layout (lut_ops.cpp's gemm_layout): zeros
    for kernel, stride in ((3, 2), (3, 1), (1, 2)):
        out = ops.lut_conv2d(torch.zeros((64, 0, 14, 14), dtype=torch.int8, device=DEV),
                             torch.zeros((8, 0, kernel, kernel), dtype=torch.int8, device=DEV), lut,
                             [stride, stride], [kernel // 2] * 2, [1, 1], 1, "auto")
        assert out.shape == (64, 8, 14 // stride, 14 // stride) and int(out.abs().sum()) == 0


def test_opcheck_cuda():
    import runner.ops  # noqa: F401  (registers the fake kernels)

    gen = torch.Generator().manual_seed(5)
    a = make_codes(gen, (37, 19), True).to(DEV)
    w = make_weights(gen, (11, 19), True).to(DEV)
    lut = make_lut(gen, "int16").to(DEV)
    torch.library.opcheck(ops.lut_linear.default, (a, w, lut, "direct"))
    torch.library.opcheck(ops.lut_linear.default, (a, w, lut, "expanded"))
    x = make_codes(gen, (2, 4, 9, 9), False).to(DEV)
    wc = make_weights(gen, (6, 2, 3, 3), False).to(DEV)
    torch.library.opcheck(ops.lut_conv2d.default, (x, wc, lut, [2, 1], [1, 1], [1, 2], 2, "auto"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_process_moves_between_gpus():
    """A sweep worker may run one job on GPU 1 and its next on GPU 0: every variant must work on a
    GPU after running on another (per-device kernel attributes), with the same results."""
    gen = torch.Generator().manual_seed(11)
    a = make_codes(gen, (4, 6, 12, 12), False)
    w = make_weights(gen, (16, 6, 5, 5), False)
    lut = make_lut(gen, "int16")
    expected = reference_lut_conv2d(a, w, lut)
    for dev in ("cuda:1", "cuda:0", "cuda:1"):
        for algo in ["direct", "expanded_smem", "expanded_l2", "expanded", "auto"]:
            out = ops.lut_conv2d(a.to(dev), w.to(dev), lut.to(dev), [1, 1], [0, 0], [1, 1], 1, algo)
            assert torch.equal(out.cpu(), expected), (dev, algo)
