"""Reference LUT layers and model conversion: the quantized arithmetic, on the python backend."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner._ext import backend_status
from runner.errors import UserError
from runner.layers import (ApproxConv2d, ApproxLinear, FakeQuantConv2d, auto_picks, convert_model, quantized_layers,
                           quantized_models)
from runner.multipliers import resolve
from runner.ops import backend_algos
from runner.quant import QuantConfig, calibrate, quantize_act, quantize_weight
from tests.conftest import has_cpp

BACKENDS = ["python"] + (["cpp"] if has_cpp() else [])
BACKENDS_ALL = [b for b, state in backend_status().items() if state == "available"]


@pytest.fixture(scope="module")
def exact_s():
    return resolve({"name": "exact"})


@pytest.fixture(scope="module")
def exact_u():
    return resolve({"name": "exact_unsigned"})


def assert_matches_fakequant(approx, fq, x, approx_logits, fq_logits):
    """Layer by layer, on the same input, and end to end, the outputs are the same bits: both sum the same
    integer products exactly (fake-quant in float64, the LUT in int32) and finish with the same arithmetic."""
    inputs = {}
    hooks = [getattr(fq, n).register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
             for n in ("conv1", "conv2", "fc1", "fc2", "fc3")]
    try:
        with torch.no_grad():
            fq(x)
            for name, inp in inputs.items():
                assert torch.equal(getattr(approx, name)(inp), getattr(fq, name)(inp)), name
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(approx_logits, fq_logits)


def test_exact_lut_conv_accumulators_equal_integer_conv(exact_s):
    """Layer output = int64 conv of the codes, dequantized: nothing is lost in the LUT path."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2)
    x = torch.randn(3, 4, 9, 9)
    stats = calibrate(nn.Sequential(conv), x, QuantConfig(calib_batches=1, calib_batch_size=3))
    layer = ApproxConv2d(conv, exact_s, QuantConfig(), stats["0"], backend="python")
    codes = quantize_act(x, layer.act_scale, True)
    wq = quantize_weight(conv.weight, layer.weight_scale)
    acc = torch.nn.functional.conv2d(codes.double(), wq.double(), None, 2, 1, 1, 2)
    expected = acc.float() * (layer.act_scale * layer.weight_scale).view(1, -1, 1, 1) + conv.bias.view(1, -1, 1, 1)
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("requant", ["float", "integer"])
def test_exact_lut_model_matches_fakequant(trained_lenet, mnist5k, exact_s, exact_u, backend, granularity, signed,
                                           requant):
    """The seed project's failure (trained weights in custom layers -> 10% accuracy) cannot happen:
    with the exact LUT the custom-MAC model reproduces fake-quant's logits on every image, bit for bit."""
    model, _ = trained_lenet
    q = QuantConfig(weight=granularity, calib_batches=2, requant=requant)
    fq, approx, _ = quantized_models(model, exact_s if signed else exact_u, q, mnist5k.train_x, backend=backend)
    # the whole test set on the fast kernels; the python oracle is slow on purpose, so a slice there
    n = None if backend != "python" else 200
    x, y = mnist5k.test_x[:n], mnist5k.test_y[:n]
    with torch.no_grad():
        lf, la, l32 = fq(x), approx(x), model(x)
    assert torch.equal(lf, la)
    acc_ap = (la.argmax(1) == y).float().mean()
    assert acc_ap > 0.85
    assert_matches_fakequant(approx, fq, x[:200], la, lf)
    # and int8 stays close to fp32
    assert ((l32.argmax(1) == y).float().mean() - acc_ap).abs() < 0.02


def test_approximate_lut_changes_results(trained_lenet, mnist5k):
    model, _ = trained_lenet
    coarse = resolve({"family": "optrunc", "k": 5, "signed": True})
    _, approx, _ = quantized_models(model, coarse, QuantConfig(calib_batches=1), mnist5k.train_x)
    fq, exact, _ = quantized_models(model, resolve({"name": "exact"}), QuantConfig(calib_batches=1), mnist5k.train_x)
    with torch.no_grad():
        assert not torch.allclose(approx(mnist5k.test_x[:100]), exact(mnist5k.test_x[:100]), atol=1e-2)


def test_convert_selected_layers_copies_weights(trained_lenet, mnist5k, exact_s):
    model, _ = trained_lenet
    stats = calibrate(model, mnist5k.train_x, QuantConfig(calib_batches=1))
    out = convert_model(model, exact_s, QuantConfig(), stats, layers=["conv2", "fc3"])
    assert isinstance(out.conv2, ApproxConv2d) and isinstance(out.fc3, ApproxLinear)
    assert type(out.conv1) is nn.Conv2d and type(out.fc1) is nn.Linear
    assert torch.equal(out.conv2.weight, model.conv2.weight) and out.conv2.lut.dtype == torch.int32
    assert isinstance(convert_model(model, exact_s, QuantConfig(), stats, fake=True).conv1, FakeQuantConv2d)
    with pytest.raises(UserError, match="not Conv2d/Linear"):
        convert_model(model, exact_s, QuantConfig(), stats, layers=["pool"])


def test_unsigned_multiplier_rejects_negative_inputs(trained_lenet, mnist5k, exact_u):
    model, _ = trained_lenet  # not folded: conv1 sees normalised pixels, which go negative
    stats = calibrate(model, mnist5k.train_x, QuantConfig(calib_batches=1))
    with pytest.raises(UserError, match="unsigned.*conv1.*negative"):
        convert_model(model, exact_u, QuantConfig(), stats)
    convert_model(model, exact_u, QuantConfig(), stats, layers=["conv2", "fc1"])  # ReLU inputs are fine


def test_per_layer_multipliers(trained_lenet, mnist5k):
    from runner.multipliers import resolve_per_layer

    model, _ = trained_lenet
    spec = {"name": "exact", "layers": {"fc3": {"name": "mul8s_1L2J"}}}
    per = resolve_per_layer(spec, ["conv1", "conv2", "fc1", "fc2", "fc3"])
    _, approx, _ = quantized_models(model, per, QuantConfig(calib_batches=1), mnist5k.train_x)
    assert approx.fc3.multiplier_name == "mul8s_1L2J" and approx.conv1.multiplier_name == "exact_s"


@pytest.mark.parametrize("requant", ["float", "integer"])
def test_dynamic_activation_scale(trained_lenet, mnist5k, exact_s, requant):
    """Per-batch scales: with requant=integer no scale is known ahead, so every layer dequantizes with its
    int32 bias (taken at each batch's scale, never a stale one)."""
    model, _ = trained_lenet
    fq, approx, _ = quantized_models(model, exact_s, QuantConfig(activation="dynamic", calib_batches=1,
                                                                 requant=requant), mnist5k.train_x)
    assert approx.fc1.dynamic and fq.fc1.dynamic and approx.conv1.__dict__["_consumer"] is None
    x = mnist5k.test_x[:200]
    with torch.no_grad():
        assert_matches_fakequant(approx, fq, x, approx(x), fq(x))
        # a batch of another range in between (other scales, other int32 biases) leaves nothing stale behind
        first = approx(x[:50])
        approx(3 * x)
        assert torch.equal(approx(x[:50]), first)


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("cuda", marks=pytest.mark.cuda)])
def test_set_multiplier_equals_a_fresh_conversion(trained_lenet, mnist5k, backend):
    """A converted model reused with another table (a sweep converts once) computes what a model converted
    for that table does, also after the first table's prepared tables were cached by a forward."""
    if backend not in BACKENDS_ALL or (backend == "cuda" and not torch.cuda.is_available()):
        pytest.skip(f"no {backend} backend here")
    model, _ = trained_lenet
    dev = "cuda" if backend == "cuda" else "cpu"
    x = mnist5k.test_x[:300].to(dev)
    first, second = resolve({"name": "mul8s_1L2N"}), resolve({"name": "mul8s_1KX5"})
    first_lut = first.lut.clone()
    qcfg = QuantConfig(calib_batches=1)
    _, reused, _ = quantized_models(model, first, qcfg, mnist5k.train_x, backend=backend)
    _, fresh, _ = quantized_models(model, second, qcfg, mnist5k.train_x, backend=backend)
    reused, fresh = reused.to(dev), fresh.to(dev)
    with torch.no_grad():
        before = reused(x)
        for layer in (reused.conv1, reused.conv2, reused.fc1, reused.fc2, reused.fc3):
            layer.set_multiplier(second)
        assert reused.fc2.multiplier_name == "mul8s_1KX5"
        after = reused(x)
        assert torch.equal(after, fresh(x)) and not torch.equal(after, before)
    # the first table is the registry's own tensor, shared by every model made from it: left as it was
    assert torch.equal(first.lut, resolve({"name": "mul8s_1L2N"}).lut) and torch.equal(first.lut, first_lut)
    with pytest.raises(ValueError, match="signed"):
        reused.fc1.set_multiplier(resolve({"name": "mul8u_T83"}))
    wide = resolve({"name": "exact"})
    reused.fc1.reduction_k = 2**20  # a table whose sums could leave int32 at this K is refused
    with pytest.raises(UserError, match="accumulator"):
        reused.fc1.set_multiplier(wide)


@pytest.mark.cuda
@pytest.mark.parametrize("requant", ["float", "integer"])
@pytest.mark.parametrize("table", ["mul8s_1L2J", "mul8u_T83"])
def test_cuda_model_bit_identical_to_cpp(trained_lenet, mnist5k, requant, table):
    """Every stage is exact or rounds like the CPU (integer LUT sums, IEEE round-to-nearest quantize and
    dequantize, integer requantize), so the whole approximate LeNet-5 gives the same logits on the GPU as on
    the CPU; and so does fake-quant (exact sums of its codes, no cuDNN or TF32 sums)."""
    if not torch.cuda.is_available() or "cuda" not in BACKENDS_ALL:
        pytest.skip("no CUDA device / CUDA kernels")
    model, _ = trained_lenet
    mult = resolve({"name": table})
    q = QuantConfig(calib_batches=1, requant=requant)
    fq, cpu_model, _ = quantized_models(model, mult, q, mnist5k.train_x, backend="cpp")
    # calibrating a model that lives on the GPU gives the CPU's scales (the fixture's model stays on the CPU)
    _, gpu_model, _ = quantized_models(copy.deepcopy(model).cuda(), mult, q, mnist5k.train_x.cuda(), backend="cuda")
    with torch.no_grad():
        on_cpu, fq_cpu = cpu_model(mnist5k.test_x), fq(mnist5k.test_x)
        on_gpu = gpu_model.cuda()(mnist5k.test_x.cuda()).cpu()
        fq_gpu = fq.cuda()(mnist5k.test_x.cuda()).cpu()
    assert torch.equal(on_cpu, on_gpu)
    assert torch.equal(fq_cpu, fq_gpu)


@pytest.mark.cuda
@pytest.mark.parametrize("requant", ["float", "integer"])
def test_cuda_layers_bit_identical_to_cpp_on_rounding_ties(exact_s, requant):
    """Layer by layer on inputs at and next to quantization ties: quantize, LUT sums, dequantize or
    requantize give the same bits on the GPU as on the CPU (and the python reference)."""
    if not torch.cuda.is_available() or "cuda" not in BACKENDS_ALL:
        pytest.skip("no CUDA device / CUDA kernels")
    outs = {b: _tie_model_outputs(exact_s, requant, b) for b in ("python", "cpp", "cuda")}
    for name in outs["python"]:
        assert torch.equal(outs["cpp"][name], outs["cuda"][name]), name
        assert torch.equal(outs["python"][name], outs["cpp"][name]), name


@pytest.mark.parametrize("backend", ["cpp", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_auto_picks_name_each_layers_variant(trained_lenet, mnist5k, exact_s, backend):
    """What compare's run.json records: per LUT layer, the variant auto chose for its last input, as
    the kernels report it; nothing before the first call."""
    if backend not in BACKENDS_ALL:
        pytest.skip(f"backend {backend} not available here")
    model, _ = trained_lenet
    _, approx, _ = quantized_models(model, exact_s, QuantConfig(calib_batches=1), mnist5k.train_x, backend=backend)
    device = "cuda" if backend == "cuda" else "cpu"
    approx = approx.to(device)
    assert set(auto_picks(approx).values()) == {""}
    with torch.no_grad():
        approx(mnist5k.test_x[:300].to(device))
    picks = auto_picks(approx)
    names = backend_algos(backend)
    assert set(picks) == {"conv1", "conv2", "fc1", "fc2", "fc3"}
    # a variant's name, or one of its configurations (expanded_rows_r2_c1, expanded_window_c16)
    assert all(any(p == n or p.startswith(n + "_") for n in names) for p in picks.values()), picks


class _Chain(nn.Module):
    """conv -> ReLU -> max-pool -> flatten -> fc1 -> act -> fc2, its forward listed by stages()."""

    def __init__(self, act: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc1, self.fc2 = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 4 * 4, 32), nn.Linear(32, 10)
        self.relu, self.pool, self.flat, self.act = nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1), act or nn.ReLU()

    def stages(self):
        return [("conv", self.conv), ("", self.relu), ("", self.pool), ("", self.flat), ("fc1", self.fc1),
                ("", self.act), ("fc2", self.fc2)]

    def forward(self, x):
        for _, step in self.stages():
            x = step(x)
        return x


def _tie_inputs(scale: float, signed: bool, n=64):
    """Inputs on, just above and just below the quantization ties (k + 0.5) * scale."""
    gen = torch.Generator().manual_seed(5)
    ties = (torch.randint(-140, 140, (n, 3, 8, 8), generator=gen).float() + 0.5) * scale
    side = torch.randint(0, 3, ties.shape, generator=gen)
    x = torch.where(side == 0, ties, torch.nextafter(ties, torch.where(side == 1, 1.0, -1.0) * float("inf")))
    return x if signed else x.abs()


def _tie_model_outputs(mult, requant, backend):
    """Every quantized layer's output of a converted _Chain on tie inputs, on the CPU."""
    model = _Chain()
    calib = torch.randn(256, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    calib = calib if mult.signed else calib.abs()
    q = QuantConfig(calib_batches=1, requant=requant)
    stats = calibrate(model, calib, q)
    approx = convert_model(model, mult, q, stats, backend=backend)
    device = "cuda" if backend == "cuda" else "cpu"
    approx = approx.to(device)
    outs = {}
    for name, m in quantized_layers(approx).items():
        m.register_forward_hook(lambda mod, a, out, name=name: outs.__setitem__(name, out.cpu()))
    x = _tie_inputs(float(approx.conv.act_scale), mult.signed)
    with torch.no_grad():
        approx(x.to(device))
    return outs


@pytest.mark.skipif(not has_cpp(), reason="runner._C not built")
@pytest.mark.parametrize("requant", ["float", "integer"])
@pytest.mark.parametrize("table", ["mul8s_1L2J", "exact_unsigned"])
def test_layers_bit_identical_python_cpp_on_rounding_ties(requant, table):
    mult = resolve({"name": table})
    py, cpp = _tie_model_outputs(mult, requant, "python"), _tie_model_outputs(mult, requant, "cpp")
    assert set(py) == {"conv", "fc1", "fc2"}
    for name in py:
        assert torch.equal(py[name], cpp[name]), name


@pytest.mark.skipif(not has_cpp(), reason="runner._C not built")
@pytest.mark.parametrize("requant", ["float", "integer"])
@pytest.mark.parametrize("table", ["mul8s_1L2J", "mul8u_T83"])
def test_python_and_cpp_models_bit_identical(trained_lenet, mnist5k, requant, table):
    """The whole approximate LeNet-5: same logits from the python reference and the C++ kernels."""
    model, _ = trained_lenet
    q = QuantConfig(calib_batches=1, requant=requant)
    mult = resolve({"name": table})
    _, py, _ = quantized_models(model, mult, q, mnist5k.train_x, backend="python")
    _, cpp, _ = quantized_models(model, mult, q, mnist5k.train_x, backend="cpp")
    x = mnist5k.test_x[:200]
    with torch.no_grad():
        assert torch.equal(py(x), cpp(x))


def test_consumers_follow_code_preserving_steps(trained_lenet, mnist5k, exact_s):
    """requant=integer hands codes only along ReLU / max-pool / flatten to the next quantized layer;
    anything else gets the fp32 output. A model without stages() is linked from its traced forward."""
    q = QuantConfig(calib_batches=1, requant="integer")
    fq, approx, _ = quantized_models(trained_lenet[0], exact_s, q, mnist5k.train_x)
    for m in (fq, approx):
        chain = [m.conv1.__dict__["_consumer"], m.conv2.__dict__["_consumer"], m.fc1.__dict__["_consumer"],
                 m.fc2.__dict__["_consumer"], m.fc3.__dict__["_consumer"]]
        assert chain == [m.conv2, m.fc1, m.fc2, m.fc3, None]
    x = torch.randn(32, 3, 8, 8)
    tanh = convert_model(_Chain(nn.Tanh()), exact_s, q, calibrate(_Chain(nn.Tanh()), x, q))
    assert tanh.conv.__dict__["_consumer"] is tanh.fc1 and tanh.fc1.__dict__["_consumer"] is None
    seq = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    plain = convert_model(seq, exact_s, q, calibrate(seq, torch.randn(16, 5), q))
    assert plain[0].__dict__["_consumer"] is plain[2] and plain[2].__dict__["_consumer"] is None


def test_integer_requant_codes_are_the_float_paths_codes(trained_lenet, mnist5k, exact_s):
    """The fixed-point multiplier is the real one: the codes conv1 hands conv2 in integer mode are the codes
    conv2 takes from conv1's fp32 output in float mode, but for rare ties (the bias rounded to the
    accumulator's scale, round-half-up against half-even)."""
    model = trained_lenet[0]
    outs = {}
    for requant in ("float", "integer"):
        q = QuantConfig(calib_batches=1, requant=requant)
        _, approx, _ = quantized_models(model, exact_s, q, mnist5k.train_x, backend="python")
        approx.conv2.register_forward_pre_hook(lambda m, a, r=requant: outs.__setitem__(
            r, quantize_act(a[0], m.act_scale, m.signed).int()))
        with torch.no_grad():
            approx(mnist5k.test_x[:100])
    diff = (outs["float"] - outs["integer"]).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.999


def test_integer_requant_follows_a_new_consumer_scale(trained_lenet, mnist5k, exact_s):
    """Recalibration moves a consumer's scale: the producer's requantization follows it (cached per scale
    version), giving what a fresh conversion with the new statistics gives."""
    from runner.models import fold_input_normalization

    q = QuantConfig(calib_batches=1, requant="integer")
    folded = fold_input_normalization(trained_lenet[0])
    stats = calibrate(folded, mnist5k.train_x, q)
    approx = convert_model(folded, exact_s, q, stats, backend="python")
    x = mnist5k.test_x[:50]
    with torch.no_grad():
        before = approx(x)
        moved = {**stats, "fc1": type(stats["fc1"])(stats["fc1"].min, stats["fc1"].amax_signed * 1.7,
                                                    stats["fc1"].amax_unsigned * 1.7)}
        approx.fc1.set_act_amax(moved["fc1"])
        after, fresh = approx(x), convert_model(folded, exact_s, q, moved, backend="python")(x)
    assert not torch.equal(before, after) and torch.equal(after, fresh)


@pytest.mark.parametrize("shape,wshape,stride,padding,dilation,groups", [
    ((3, 6, 13, 11), (10, 6, 3, 3), 2, 1, 1, 1),          # 3x3 stride 2, odd planes
    ((2, 8, 7, 7), (8, 1, 3, 3), 1, 1, 1, 8),             # depthwise
    ((2, 4, 17, 15), (150, 2, 3, 3), 3, 2, 2, 2),         # groups, dilation
    ((2, 4, 10, 13), (6, 2, 3, 2), (1, 2), (2, 1), (2, 1), 2),
    ((4, 32, 16, 16), (64, 32, 1, 1), 2, 0, 1, 1),        # 1x1 stride-2 shortcut
])
def test_unfold_conv2d_is_conv2d(shape, wshape, stride, padding, dilation, groups):
    """The GPU's exact fake-quant convolution (im2col + batched matmul, in batch slices) gives conv2d's integers,
    whatever the slice size."""
    from runner.exact_conv import unfold_conv2d

    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-128, 128, shape, generator=gen).double()
    w = torch.randint(-127, 128, wshape, generator=gen).double()
    want = F.conv2d(x, w, None, stride, padding, dilation, groups)
    for max_elements in (1 << 27, 50):
        assert torch.equal(unfold_conv2d(x, w, stride, padding, dilation, groups, max_elements=max_elements), want)
    # the strided-copy unfold the lut gradient and this convolution use is F.unfold exactly
    from runner.exact_conv import unfold

    kernel = wshape[2:]
    assert torch.equal(unfold(x, kernel, dilation, padding, stride),
                       F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape,wshape,stride,padding,dilation", [
    ((3, 6, 13, 11), (10, 6, 3, 3), 2, 1, 1),      # K = 54, N = 10: both padded to multiples of 8
    ((1, 3, 5, 5), (4, 3, 3, 3), 1, 0, 1),         # 9 rows: padded above 16
    ((2, 4, 17, 15), (150, 4, 3, 3), 3, 2, 2),     # dilation, stride 3
    ((2, 4, 10, 13), (6, 4, 3, 2), (1, 2), (2, 1), (2, 1)),
    ((4, 32, 16, 16), (64, 32, 1, 1), 2, 0, 1),    # 1x1 stride-2 shortcut
    ((2, 3, 23, 23), (8, 3, 7, 7), 2, 3, 1),       # a 7x7 stem
])
def test_int_mm_conv2d_is_conv2d(shape, wshape, stride, padding, dilation, signed):
    """The GPU's fake-quant convolution through the integer GEMM (channels-last taps, unsigned codes shifted by
    128 and corrected, rows / taps / channels padded for the kernel) gives conv2d's integers, whatever the batch
    slice; torch._int_mm runs the same arithmetic on the CPU."""
    from runner.exact_conv import int_mm, int_mm_conv2d

    gen = torch.Generator().manual_seed(7)
    x = (torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8) if signed else
         torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8))
    w = torch.randint(-127, 128, wshape, generator=gen, dtype=torch.int8)
    want = F.conv2d(x.double(), w.double(), None, stride, padding, dilation).to(torch.int64)
    for max_elements in (1 << 27, 200):
        got = int_mm_conv2d(x, w, stride, padding, dilation, max_elements=max_elements)
        assert got.dtype == torch.int32 and torch.equal(got.to(torch.int64), want)
    rows = x.flatten().repeat(10)[: 13 * 38].view(13, 38)[:, 1:]  # 13 rows (padded to 17), K = 37, strided
    lin = torch.randint(-127, 128, (5, rows.shape[1]), generator=gen, dtype=torch.int8)
    assert torch.equal(int_mm(rows, lin).to(torch.int64), rows.to(torch.int64) @ lin.to(torch.int64).t())


@pytest.mark.cuda
def test_exact_conv2d_on_the_gpu_equals_the_cpu():
    from runner.exact_conv import exact_conv2d

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(6)
    for signed, k in ((True, 64), (False, 600)):  # float32 sums, and float64 ones (255 * 127 * 600 > 2^24)
        codes = (torch.randint(-128, 128, (9, k, 8, 8), generator=gen, dtype=torch.int8) if signed else
                 torch.randint(0, 256, (9, k, 8, 8), generator=gen, dtype=torch.uint8))
        w = torch.randint(-127, 128, (16, k, 3, 3), generator=gen, dtype=torch.int8)
        want = exact_conv2d(codes, w, (1, 1), (1, 1), (1, 1), 1)
        assert torch.equal(exact_conv2d(codes.cuda(), w.cuda(), (1, 1), (1, 1), (1, 1), 1).cpu(), want)


def test_converted_models_pool_in_pairs(exact_s):
    from runner.pooling import PairMaxPool2d
    from runner.models.lenet import LeNet5
    model = LeNet5().eval()
    stats = calibrate(model, torch.rand(64, 1, 28, 28), QuantConfig())
    for fake in (True, False):
        converted = convert_model(model, exact_s, QuantConfig(), stats, fake=fake)
        assert type(converted.pool) is PairMaxPool2d and type(model.pool) is nn.MaxPool2d


def test_fake_quant_weight_codes_follow_every_weight_change(exact_s):
    """Inference reuses the weight codes while weights and scales stand still, and a changed weight (an optimizer
    step, load_state_dict) gives the codes and outputs a fresh conversion gives."""
    gen = torch.Generator().manual_seed(5)
    layer = nn.Linear(16, 4)
    x = torch.rand(8, 16, generator=gen)
    stats = calibrate(nn.Sequential(layer), x, QuantConfig())
    fq = convert_model(nn.Sequential(layer), exact_s, QuantConfig(), stats, fake=True)[0]
    with torch.no_grad():
        fq(x)
        codes = fq._weight_codes()
        fq(x)
        assert fq._weight_codes() is codes
        fq.weight.mul_(-0.5)
        changed = fq(x)
        assert not torch.equal(fq._weight_codes(), codes)
        layer.weight.mul_(-0.5)
        fresh = convert_model(nn.Sequential(layer), exact_s, QuantConfig(), stats, fake=True)[0]
        assert torch.equal(fq._weight_codes(), quantize_weight(fresh.weight, fresh.weight_scale))
        assert torch.equal(changed, fresh(x))
