"""Reference LUT layers and model conversion: the quantized arithmetic, on the python backend."""
import pytest
import torch
from torch import nn

from runner._ext import backend_status
from runner.errors import UserError
from runner.layers import ApproxConv2d, ApproxLinear, FakeQuantConv2d, auto_picks, convert_model, quantized_models
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
    """Layer by layer, on the same input, outputs differ by fp32 rounding only (exact int32 sums vs fp32
    sums of the same products). End to end that rounding can tip a rare next-layer code across a .5
    boundary, so there most logits, not all, are that close."""
    inputs = {}
    hooks = [getattr(fq, n).register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
             for n in ("conv1", "conv2", "fc1", "fc2", "fc3")]
    try:
        with torch.no_grad():
            fq(x)
            for name, inp in inputs.items():
                torch.testing.assert_close(getattr(approx, name)(inp), getattr(fq, name)(inp), rtol=1e-5, atol=1e-4)
    finally:
        for h in hooks:
            h.remove()
    close = (approx_logits - fq_logits).abs() <= 1e-4 + 1e-4 * fq_logits.abs()
    assert close.float().mean() >= 0.97
    assert (approx_logits.argmax(1) == fq_logits.argmax(1)).float().mean() >= 0.99


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
def test_exact_lut_model_matches_fakequant(trained_lenet, mnist5k, exact_s, exact_u, backend, granularity, signed):
    """The seed project's failure (trained weights in custom layers -> 10% accuracy) cannot happen:
    with the exact LUT the custom-MAC model reproduces fake-quant's predictions and accuracy."""
    model, _ = trained_lenet
    q = QuantConfig(weight=granularity, calib_batches=2)
    fq, approx, _ = quantized_models(model, exact_s if signed else exact_u, q, mnist5k.train_x, backend=backend)
    # the whole test set on the fast kernels; the python oracle is slow on purpose, so a slice there
    n = None if backend != "python" else 200
    x, y = mnist5k.test_x[:n], mnist5k.test_y[:n]
    with torch.no_grad():
        lf, la, l32 = fq(x), approx(x), model(x)
    agree = (lf.argmax(1) == la.argmax(1)).float().mean().item()
    assert agree >= 0.999
    acc_fq, acc_ap = (lf.argmax(1) == y).float().mean(), (la.argmax(1) == y).float().mean()
    assert abs(acc_fq - acc_ap) <= 0.001 and acc_ap > 0.85
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


def test_dynamic_activation_scale(trained_lenet, mnist5k, exact_s):
    model, _ = trained_lenet
    fq, approx, _ = quantized_models(model, exact_s, QuantConfig(activation="dynamic", calib_batches=1),
                                     mnist5k.train_x)
    assert approx.fc1.dynamic and fq.fc1.dynamic
    x = mnist5k.test_x[:200]
    with torch.no_grad():
        assert_matches_fakequant(approx, fq, x, approx(x), fq(x))


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
def test_cuda_model_bit_identical_to_cpp(trained_lenet, mnist5k):
    """Every stage is exact or rounds like the CPU (integer LUT sums, IEEE round-to-nearest quantize and
    dequantize), so the whole approximate LeNet-5 gives the same logits on the GPU as on the CPU."""
    if not torch.cuda.is_available() or "cuda" not in BACKENDS_ALL:
        pytest.skip("no CUDA device / CUDA kernels")
    model, _ = trained_lenet
    mult = resolve({"name": "mul8s_1L2J"})
    _, cpu_model, _ = quantized_models(model, mult, QuantConfig(calib_batches=1), mnist5k.train_x, backend="cpp")
    _, gpu_model, _ = quantized_models(model, mult, QuantConfig(calib_batches=1), mnist5k.train_x, backend="cuda")
    with torch.no_grad():
        on_cpu = cpu_model(mnist5k.test_x)
        on_gpu = gpu_model.cuda()(mnist5k.test_x.cuda()).cpu()
    assert torch.equal(on_cpu, on_gpu)


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
    assert all(any(p == n or p.startswith(n + "_r") for n in names) for p in picks.values()), picks
