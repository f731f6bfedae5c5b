"""Numeric guards: the int32 accumulator bound (from K and the table's range) at its edge, and NaN/Inf
in inputs, weights or calibration reported with the layer's name instead of becoming codes."""
import pytest
import torch
from torch import nn

from runner import ops
from runner.errors import UserError
from runner.evaluate import run_timed
from runner.layer_checks import NonFiniteInputCheck, check_accumulator, check_non_finite_inputs, reduction_length
from runner.layers import ApproxLinear, quantized_layers, quantized_models
from runner.models import build_model, run_from, run_until
from runner.multipliers import Multiplier, get
from runner.quant import ActStats, QuantConfig
from tests.conftest import compose, has_cpp

BACKENDS = ["python"] + (["cpp"] if has_cpp() else [])
STATS = ActStats(min=0.0, amax_signed=1.0, amax_unsigned=1.0)


def _constant(signed: bool, value: int) -> Multiplier:
    return Multiplier("const", signed, torch.full((256, 256), value, dtype=torch.int32))


# the largest K whose sum of extreme products fits int32: 32768 * 65535 = 2^31 - 32768,
# 65536 * -32768 = -2^31 exactly
@pytest.mark.parametrize("signed, extreme, k_max", [(False, 65535, 32768), (True, -32768, 65536)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulator_bound_is_tight(signed, extreme, k_max, backend):
    m = _constant(signed, extreme)
    ApproxLinear(nn.Linear(k_max, 2), m, QuantConfig(), STATS, backend, "auto", name="wide")
    with pytest.raises(UserError, match=f"layer wide: sums K={k_max + 1:,} products.*at most K={k_max:,}"):
        ApproxLinear(nn.Linear(k_max + 1, 2), m, QuantConfig(), STATS, backend, "auto", name="wide")
    # the kernels sum k_max extreme products exactly; one more would wrap, which is what the guard prevents
    dtype = torch.int8 if signed else torch.uint8
    for k, expect in ((k_max, k_max * extreme), (k_max + 1, None)):
        out = ops.lut_linear(torch.full((1, k), 3, dtype=dtype), torch.full((1, k), 3, dtype=torch.int8), m.lut,
                             backend=backend)
        if expect is not None:
            assert out.item() == expect
        else:
            assert out.item() != k * extreme and abs(out.item()) < 2 ** 31


def test_bound_uses_the_tables_own_range():
    # a table whose products stay small allows a longer sum than the widest 16-bit table would
    check_accumulator("fc", 100_000, _constant(False, 20_000).value_bounds)
    with pytest.raises(UserError, match="largest \\|product\\| is at most 21,474"):
        check_accumulator("fc", 100_000, _constant(False, 30_000).value_bounds)


def test_reduction_length_of_convolutions():
    assert reduction_length(nn.Conv2d(8, 4, 3, groups=2)) == 4 * 9
    assert reduction_length(nn.Conv2d(6, 16, 5)) == 150 and reduction_length(nn.Linear(256, 120)) == 256


def test_every_lenet5_layer_with_every_table_is_far_inside_the_bound():
    from runner.multipliers import list_multipliers

    model = build_model(compose("compare").model, 0.0, 1.0)
    widest = max(max(abs(int(get(n).lut.min())), abs(int(get(n).lut.max()))) for n in list_multipliers())
    ks = [reduction_length(l) for l in model.modules() if isinstance(l, (nn.Conv2d, nn.Linear))]
    assert max(ks) * widest < 2 ** 31 // 100


@pytest.fixture(scope="module")
def lenet():
    torch.manual_seed(0)
    return build_model(compose("compare").model, 0.0, 1.0).eval()


@pytest.mark.parametrize("what, value", [("weight", float("nan")), ("bias", float("inf"))])
def test_non_finite_parameter_is_named_at_conversion(lenet, what, value):
    bad = __import__("copy").deepcopy(lenet)
    with torch.no_grad():
        getattr(bad.fc1, what).view(-1)[3] = value
    with pytest.raises(UserError, match=f"layer fc1: the {what} holds 1 non-finite value"):
        quantized_models(bad, get("mul8s_1L2J"), QuantConfig(calib_batches=1, calib_batch_size=8),
                         torch.rand(8, 1, 28, 28))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_input_is_named_not_coded(lenet, backend):
    fq, approx, _ = quantized_models(lenet, get("mul8s_1L2J"), QuantConfig(calib_batches=1, calib_batch_size=8),
                                     torch.rand(8, 1, 28, 28), backend=backend)
    x = torch.rand(4, 1, 28, 28)
    x[2, 0, 5, 5] = float("nan")
    for model in (fq, approx):
        with pytest.raises(UserError, match="layer conv1: the input holds 1 non-finite value.*nan"):
            model(x)


def test_non_finite_calibration_is_named(lenet):
    x = torch.rand(8, 1, 28, 28)
    x[0, 0, 0, 0] = float("inf")
    with pytest.raises(UserError, match="layer conv1: the calibrated input range holds"):
        quantized_models(lenet, get("mul8s_1L2J"), QuantConfig(calib_batches=1, calib_batch_size=8), x)


def test_weights_that_diverge_in_training_are_named(lenet):
    _, approx, _ = quantized_models(lenet, get("mul8s_1L2J"), QuantConfig(calib_batches=1, calib_batch_size=8),
                                    torch.rand(8, 1, 28, 28))
    with torch.no_grad():
        approx.fc2.weight[0, 0] = float("inf")      # what an optimizer step with a huge lr leaves
    with pytest.raises(UserError, match="layer fc2: the weight holds 1 non-finite value"):
        approx(torch.rand(2, 1, 28, 28))




def test_deferred_input_check_names_the_first_bad_layer(lenet):
    """The GPU path: layers only flag on the device, the model's forward hook reads the flags once."""
    _, approx, _ = quantized_models(lenet, get("mul8s_1L2J"), QuantConfig(calib_batches=1, calib_batch_size=8),
                                    torch.rand(8, 1, 28, 28))
    layers = quantized_layers(approx)
    for name, x in (("conv1", torch.rand(2, 1, 28, 28)), ("fc1", torch.full((2, 256), float("inf"))),
                    ("fc2", torch.full((2, 120), float("nan")))):
        layers[name]._check_input(x, defer=True)
    check = NonFiniteInputCheck()
    with pytest.raises(UserError, match="layer fc1: the input holds non-finite values"):
        check(approx)
    check(approx)                                     # the flags were consumed: the next forward starts clean


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["python", "cuda"])
def test_non_finite_input_on_the_gpu_is_named(lenet, backend):
    """On the GPU the approx layers learn of a bad input from their quantize kernel, the fake-quant layers
    from a check of their own, and the flags are read without stalling the forward: by the next forward,
    by check_non_finite_inputs after the last, and by the evaluation loops, which name the layer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fq, approx, _ = quantized_models(lenet, get("mul8s_1L2J"), QuantConfig(calib_batches=1, calib_batch_size=8),
                                     torch.rand(8, 1, 28, 28), backend=backend)
    x = torch.rand(4, 1, 28, 28, device="cuda")
    x[1, 0, 3, 3] = float("inf")
    bad = "layer conv1: the input holds non-finite values"
    for model in (fq.cuda(), approx.cuda()):
        model(x[:1])
        check_non_finite_inputs(model)                # a clean input passes
        model(x)
        with pytest.raises(UserError, match=bad):
            model(x[:1])                              # the next forward reads the flags of the one before
        model(x[:1])
        check_non_finite_inputs(model)                # the flags were consumed
        model(x)
        with pytest.raises(UserError, match=bad):
            check_non_finite_inputs(model)
        with pytest.raises(UserError, match=bad):
            run_timed(model, x.cpu(), 2, torch.device("cuda"), warmup=1, repeats=1)
        kept = run_until(model, x[:1], "fc1")
        kept[0, 7] = float("nan")
        run_from(model, kept, "fc1")
        with pytest.raises(UserError, match="layer fc1: the input holds non-finite values"):
            check_non_finite_inputs(model)
