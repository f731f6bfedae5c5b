"""CPU `auto`: what approx::lut_algos reports is what the next call runs (counted by
approx::lut_runs), costs are kept per key (shape, batch bucket, table format, threads), and the
choice never changes a number."""
import pytest
import torch

from runner import ops, reference

from .conftest import BACKENDS, codes, random_lut, weights

pytestmark = pytest.mark.skipif(not any(b == "cpp" for b, _ in BACKENDS), reason="runner._C not built")

# LeNet-5's layers as the ops see them (runner.bench.LENET5_LAYERS), with a conv and a linear
# shape no other test uses, so that their first call here is auto's timed trial.
ALL = {"direct", "expanded", "tiled"}  # what auto's first call of a key times (tables within budget)
LAYERS = {
    "conv1": ((1, 28, 28), (6, 1, 5, 5)),
    "conv2": ((6, 12, 12), (16, 6, 5, 5)),
    "fc1": ((256,), (120, 256)),
    "fc2": ((120,), (84, 120)),
    "fc3": ((84,), (10, 84)),
    "conv_fresh": ((1, 28, 28), (7, 1, 5, 5)),
    "fc_fresh": ((96,), (13, 96)),
}


def call(a, w, lut, algo="auto"):
    if a.dim() == 4:
        return ops.lut_conv2d(a, w, lut, backend="cpp", algo=algo)
    return ops.lut_linear(a, w, lut, backend="cpp", algo=algo)


def pick(a, w, lut):
    """auto's pick as the kernels report it ("" while not measured)."""
    return next((r["auto_pick_name"] for r in ops.algo_table(a, w, lut, backend="cpp") if r["auto_pick"]), "")


def runs():
    return torch.ops.approx.lut_runs(torch.zeros(1))


def ran(a, w, lut):
    """Runs auto once; returns (its output, the variants that computed rows, by the kernels' count)."""
    before = runs()
    out = call(a, w, lut)
    after = runs()
    return out, {n for n, x, y in zip(ops.backend_algos("cpp"), before, after) if y > x}


@pytest.mark.parametrize("batch", [1, 256, 600])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_auto_runs_what_lut_algos_reports(layer, batch):
    """Over new weights (uncached, unseen), the same weights again (seen, then cached) and other
    weights: before every call, lut_algos names the one variant that call runs; "" only before the
    key's first call, which times both. Every output equals direct's."""
    gen = torch.Generator().manual_seed(batch)
    a_shape, w_shape = LAYERS[layer]
    lut = random_lut(gen, -(2**15) + 1, 2**15)
    a = codes(gen, (batch, *a_shape), False)
    w1, w2 = weights(gen, w_shape), weights(gen, w_shape)
    for w in (w1, w1, w1, w2, w2, w2):
        said = pick(a, w, lut)
        out, variants = ran(a, w, lut)
        assert variants == ({said} if said else ALL), (said, variants)
        assert pick(a, w, lut) != ""
        assert torch.equal(out, call(a, w, lut, "direct"))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("lut_range", [2**15 - 1, 2**24], ids=["int16", "int32"])
def test_trial_splits_rows_between_variants_bit_identically(signed, lut_range):
    """A first call large enough to time slices of its own rows (then the faster variant computes the
    rest) gives exactly the reference's sums: which variant computed which rows cannot show."""
    gen = torch.Generator().manual_seed(lut_range + signed)
    lut = random_lut(gen, -lut_range, lut_range + 1)
    n = 3 if signed else 5  # a shape of its own per case: its first call is the trial
    a, w = codes(gen, (280, 1, 28, 28), signed), weights(gen, (n + (lut_range > 2**15), 1, 5, 5))
    assert pick(a, w, lut) == ""
    out, variants = ran(a, w, lut)
    assert variants == ALL
    assert torch.equal(out, reference.reference_lut_conv2d(a, w, lut))
    assert pick(a, w, lut) in ALL


def test_auto_times_tiled_not_expanded_over_the_table_budget():
    """A layer whose expanded table is over the CPU budget (64 MiB; here 1024 taps x 256 codes x 304
    channels of int16: 152 MiB) is never built or run expanded: auto's first call times direct and
    tiled only, and the pick is one of them; the output is the reference's."""
    gen = torch.Generator().manual_seed(11)
    lut = random_lut(gen, -1000, 1000)
    a, w = codes(gen, (64, 1024), False), weights(gen, (300, 1024))
    assert pick(a, w, lut) == ""
    out, variants = ran(a, w, lut)
    assert variants == {"direct", "tiled"}
    assert torch.equal(out, reference.reference_lut_linear(a, w, lut))
    assert pick(a, w, lut) in {"direct", "tiled"}
    _, variants = ran(a, w, lut)
    assert variants == {pick(a, w, lut)}


def test_costs_are_kept_per_batch_bucket_table_format_and_threads():
    """A measured key does not answer for another batch bucket, table format (int16 or int32
    products) or thread count: each is measured anew on its first call."""
    gen = torch.Generator().manual_seed(7)
    lut16, lut32 = random_lut(gen, -1000, 1000), random_lut(gen, -(2**20), 2**20)
    w = weights(gen, (11, 72))
    a = codes(gen, (40, 72), True)
    call(a, w, lut16)
    assert pick(a, w, lut16) != ""
    assert pick(a[:33], w, lut16) == pick(a, w, lut16)  # same bucket: 32..63 rows
    assert pick(a[:31], w, lut16) == ""  # 16..31 rows: not measured yet
    assert pick(a, w, lut32) == ""  # int32 table
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert pick(a, w, lut16) == ""
    finally:
        torch.set_num_threads(threads)
    assert pick(a, w, lut16) != ""


@pytest.mark.parametrize("pick,row", [("expanded_gemm_r8w", "expanded_gemm"), ("expanded_gemm_r8c", "expanded_gemm"),
                                      ("expanded_gemm_r4", "expanded_gemm"), ("expanded_gemm_r8c_k3", "expanded_gemm"),
                                      ("expanded_gemm_r16c_k2", "expanded_gemm"),
                                      ("expanded_window_x7_c18", "expanded_window"), ("direct", "direct"),
                                      ("expanded_rows_r2_c1", "expanded_rows"), ("", None),
                                      ("depthwise_rows_banked8_g2", "depthwise_rows_banked8"),
                                      ("depthwise_rows_g1", "depthwise_rows"),
                                      ("depthwise_planes_b2_i32", "depthwise_planes")])
def test_algo_table_gives_a_configuration_its_variants_row(monkeypatch, pick, row):
    # the kernels report a configuration's exact name; the table flags its variant's row and keeps the name there
    names = ["direct", "expanded_l2", "expanded_gemm", "expanded_rows", "expanded_window", "depthwise_rows",
             "depthwise_rows_banked", "depthwise_rows_banked8", "depthwise_planes"]
    op = lambda *args: (names, [0] * len(names), [""] * len(names), pick)  # noqa: E731
    monkeypatch.setattr(ops, "_compiled", lambda *args: op)
    rows = ops.algo_table(torch.zeros(2, 3, dtype=torch.int8), torch.zeros(4, 3, dtype=torch.int8),
                          torch.zeros(256, 256, dtype=torch.int32), backend="cuda")
    flagged = [(r["algo"], r["auto_pick_name"]) for r in rows if r["auto_pick"]]
    assert flagged == ([] if row is None else [(row, pick)])
