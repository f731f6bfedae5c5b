"""requant=integer's hand-offs in any model: which quantized layer hands its codes to which (runner.linking,
found by tracing the forward with torch.fx), that the zoo gets the links its architecture allows and no others,
that ReLU6 passes codes only at scales where it clips none, that an untraceable forward falls back, and that
the linked models still give the same bits on every backend and with the exact table as fake-quant."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.layers import _Quantized, approximate, convert_model, integer_links, link_consumers, quantized_layers
from runner.linking import CODES_ATTR, RELU, CodesReLU, CodesReLU6, _stage_consumers, clamps_keep_codes, find_consumers
from runner.models import LeNet5
from runner.multipliers import resolve
from runner.quant import QuantConfig, calibrate, quantize_act
from tests.conftest import has_cpp
from tests.test_models import SHAPES, _model

QCFG = QuantConfig(calib_batches=1, calib_batch_size=16)


def _converted(name: str, data: str, multiplier="exact", backend="python"):
    c, side = SHAPES[data]
    calib = torch.rand(16, c, side, side, generator=torch.Generator().manual_seed(1))
    return approximate(_model(name, data), multiplier, calib, QCFG, backend=backend)


def test_resnet8_links_each_block_conv1_to_its_conv2_only():
    """The stem's output feeds layer1's conv1 and its identity shortcut, conv2 and the shortcuts feed adds,
    fc gives the logits: only conv1 -> ReLU -> conv2 inside each block hands codes on."""
    for model in _converted("resnet8", "cifar10"):
        assert integer_links(model) == {f"layer{i}.0.conv1": f"layer{i}.0.conv2" for i in (1, 2, 3)}


def test_vgg_links_every_layer_but_the_logits():
    fq, approx = _converted("vgg", "mnist5k")
    names = list(quantized_layers(approx))
    want = dict(zip(names[:-1], names[1:]))
    assert len(names) == 8 and integer_links(approx) == want and integer_links(fq) == want
    assert want["features.17"] == "classifier.1"  # through ReLU, max-pool and Flatten


def test_mobilenetv2_links_expand_depthwise_project_through_relu6():
    fq, approx = _converted("mobilenetv2", "mnist5k")
    want = {"blocks.0.depthwise.0": "blocks.0.project.0"}
    for i in range(1, 7):
        want |= {f"blocks.{i}.expand.0": f"blocks.{i}.depthwise.0", f"blocks.{i}.depthwise.0": f"blocks.{i}.project.0"}
    assert integer_links(approx) == want and integer_links(fq) == want
    # the calibrated scales put the top code at the clamp (amax <= 6 after ReLU6); a scale whose codes reach
    # past 6 would have ReLU6 change them: that hand-off goes back to fp32, and comes back with the scale
    producer, consumer = approx.blocks[1].expand[0], approx.blocks[1].depthwise[0]
    assert consumer.signed and consumer.act_scale * 127 <= 6.0001
    assert producer._finish_args(producer.act_scale)[1] is not None
    kept = consumer.act_scale.clone()
    consumer.act_scale.fill_(0.05)
    assert "blocks.1.expand.0" not in integer_links(approx)
    assert producer._finish_args(producer.act_scale)[1] is None
    consumer.act_scale.copy_(kept)
    assert producer._finish_args(producer.act_scale)[1] is not None


def _all_clamping(model, passing, plain):
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, passing):
            m.__class__ = plain
    return model


@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_relu6_passes_a_linked_producers_codes_through_with_the_same_logits(backend):
    """Between two linked layers a ReLU6 passes the producer's output through (the requantize applied its lower
    bound as qmin 0; at the consumer's scale its upper bound changes no code): a launch and a pass over the tensor
    fewer, the same logits bit for bit as the model whose ReLU6s all clamp, fake-quant's too. A ReLU6 whose
    producer is not linked (a scale at which it would clip codes) clamps."""
    if backend == "cpp" and not has_cpp():
        pytest.skip("needs the C++ extension")
    x = torch.rand(16, 1, 28, 28, generator=torch.Generator().manual_seed(4))
    fq, approx = _converted("mobilenetv2", "mnist5k", "mul8s_1L2J", backend)
    assert isinstance(approx.blocks[1].expand[2], CodesReLU6)
    clamping, fq_clamping = (_all_clamping(m, CodesReLU6, nn.ReLU6) for m in (approx, fq))
    passed = []
    relu6 = approx.blocks[1].expand[2]
    relu6.register_forward_hook(lambda m, inp, out: passed.append(out is inp[0]))
    with torch.no_grad():
        assert torch.equal(approx(x), clamping(x)) and torch.equal(fq(x), fq_clamping(x))
        consumer = approx.blocks[1].depthwise[0]
        consumer.act_scale.fill_(0.05)  # codes past 6: not linked, the ReLU6 clamps
        approx(x)
    assert passed == [True, False]


@pytest.mark.parametrize("backend", ["python", "cpp"])
def test_shared_relu_passes_the_hand_off_and_clamps_the_residual_sum(backend):
    """A residual block calls one nn.ReLU twice: after conv1, a hand-off to conv2 (passed through: conv1's requantize
    already gave codes from 0), and after the residual add (clamped: the sum is no layer's codes). The logits are
    those of the model whose ReLUs all clamp, bit for bit, and so are fake-quant's; a plain ReLU instead of the
    pass-through on the hand-off (codes below 0 reaching conv2) would change them."""
    if backend == "cpp" and not has_cpp():
        pytest.skip("needs the C++ extension")
    x = torch.rand(16, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    fq, approx = _converted("resnet8", "cifar10", "mul8s_1L2J", backend)
    block = approx.layer1[0]
    assert isinstance(block.relu, CodesReLU) and block.conv1._link_clamps == RELU
    clamping, fq_clamping = (_all_clamping(m, CodesReLU, nn.ReLU) for m in (approx, fq))
    passed, negative = [], []
    block.relu.register_forward_hook(lambda m, inp, out: passed.append(out is inp[0]))
    block.conv2.register_forward_pre_hook(lambda m, inp: negative.append(bool((inp[0] < 0).any())))
    with torch.no_grad():
        assert torch.equal(approx(x), clamping(x)) and torch.equal(fq(x), fq_clamping(x))
    assert passed == [True, False] and negative == [False]
def test_clamps_keep_codes_decides_over_the_whole_code_range():
    relu6 = ((0.0, 6.0),)
    assert clamps_keep_codes(relu6, torch.tensor(6 / 255), signed=False)
    assert clamps_keep_codes(relu6, torch.tensor(6 / 127), signed=True)  # negative codes go to 0 as in ReLU
    assert clamps_keep_codes(relu6, torch.tensor(5 / 255), signed=False)
    assert not clamps_keep_codes(relu6, torch.tensor(6 / 255 * 1.01), signed=False)  # codes 253..255 clip
    assert not clamps_keep_codes(((-1.0, 1.0),), torch.tensor(2 / 127), signed=True)  # codes below -64 clip
    assert clamps_keep_codes(((-1.0, 1.0),), torch.tensor(1 / 128), signed=True)
    assert not clamps_keep_codes(((0.5, 6.0),), torch.tensor(0.01), signed=False)  # raises small codes


def test_lenet5_links_are_its_stages_links():
    model = LeNet5(mean=0.1307, std=0.3081).eval()
    x = torch.rand(32, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    fq, approx = approximate(model, "exact", x, QCFG, backend="python")
    want = {"conv1": "conv2", "conv2": "fc1", "fc1": "fc2", "fc2": "fc3"}

    def is_layer(mod):
        return isinstance(mod, _Quantized)
    for m in (fq, approx):
        assert integer_links(m) == want
        steps = {"conv1": ("relu", "pool"), "conv2": ("relu", "pool", "flatten"), "fc1": ("relu",), "fc2": ("relu",)}
        assert find_consumers(m, is_layer) == {k: (v, RELU, steps[k]) for k, v in want.items()}
        assert _stage_consumers(m, is_layer) == {k: (v, RELU, None) for k, v in want.items()}


class _Branchy(nn.Module):
    """Every way a chain ends or goes on in a user's functional forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.d, self.e = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 4, 1)
        self.fc, self.out = nn.Linear(4 * 4 * 4, 8), nn.Linear(8, 3)

    def forward(self, x):
        x = F.relu6(self.a(x))                              # a -> b through relu6 (kept at its scale)
        y = F.max_pool2d(F.relu(self.b(x)), 1)              # b's output read twice below: no link
        z = torch.cat([self.c(y), y], 1)                    # c feeds a concatenation: no link
        z = F.avg_pool2d(self.d(z), 2)                      # d feeds an average pool: no link
        z = F.dropout(self.e(z), 0.5, self.training)        # e -> fc through eval dropout and view
        z = self.fc(z.view(z.size(0), -1))
        return self.out(self.out(z).relu()[:, :0].sum() + z)  # `out` is called twice: never a producer


def test_user_model_links_follow_its_functional_forward():
    model = _Branchy().eval()
    x = torch.rand(16, 3, 8, 8)
    q = QuantConfig(calib_batches=1, calib_batch_size=16)
    approx = convert_model(model, resolve("exact"), q, calibrate(model, x, q))
    assert integer_links(approx) == {"a": "b", "e": "fc"}
    assert approx.a._link_clamps == ((0.0, 6.0),)
    with torch.no_grad():
        approx(x)  # runs, linked


class _DataDependent(nn.Module):
    """A forward fx cannot trace: control flow on a value."""

    def __init__(self):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4)

    def forward(self, x):
        h = self.relu(self.fc1(x))
        return self.fc2(h) if h.sum() > 0 else self.fc2(-h)


class _DataDependentStaged(_DataDependent):
    def stages(self):
        return [("fc1", self.fc1), ("", self.relu), ("fc2", self.fc2)]


@pytest.mark.parametrize("with_stages", [True, False])
def test_untraceable_forward_falls_back_to_stages_or_no_links(with_stages):
    torch.manual_seed(0)
    model = (_DataDependentStaged if with_stages else _DataDependent)().eval()
    x = torch.rand(16, 6)
    q = QuantConfig(calib_batches=1, calib_batch_size=16)
    approx = convert_model(model, resolve("exact"), q, calibrate(model, x, q))
    assert integer_links(approx) == ({"fc1": "fc2"} if with_stages else {})
    link_consumers(approx)  # again: still no error
    with torch.no_grad():
        assert approx(x).shape == (16, 4)


def test_linked_consumer_reads_codes_at_its_scale():
    """The hand-off is in effect: a linked consumer's input is exactly codes times its scale, where an
    unlinked one's (after the residual add) is not."""
    _, approx = _converted("resnet8", "cifar10")
    seen = {}
    for name in ("layer1.0.conv2", "layer2.0.conv1"):
        layer = approx.get_submodule(name)
        layer.register_forward_pre_hook(lambda m, a, name=name: seen.__setitem__(name, (a[0], m.act_scale)))
    with torch.no_grad():
        approx(torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)))

    def on_grid(x, s):
        return torch.equal(quantize_act(x, s, True).float() * s, x)
    assert on_grid(*seen["layer1.0.conv2"]) and not on_grid(*seen["layer2.0.conv1"])


@pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension")
@pytest.mark.parametrize("name,data", [("resnet8", "cifar10"), ("mobilenetv2", "mnist5k")])
def test_linked_models_bit_identical_python_cpp_and_exact_equals_fakequant(name, data):
    c, side = SHAPES[data]
    x = torch.rand(16, c, side, side, generator=torch.Generator().manual_seed(3))
    fq, py = _converted(name, data, "mul8s_1L2J", "python")
    cpp, exact = copy.deepcopy(py), copy.deepcopy(py)
    for layer in [*quantized_layers(cpp).values(), *quantized_layers(exact).values()]:
        layer.backend = "cpp"
    for layer in quantized_layers(exact).values():
        layer.set_multiplier(resolve("exact"))
    assert integer_links(py) and integer_links(py) == integer_links(cpp) == integer_links(fq)
    with torch.no_grad():
        assert torch.equal(py(x), cpp(x))
        a, f = exact(x), fq(x)
    assert torch.equal(a, f) and torch.equal(a.argmax(1), f.argmax(1))


@pytest.mark.parametrize("requant", ["integer", "float"])
def test_layer_swaps_compute_what_a_fresh_conversion_does(requant):
    """One model whose layers under test are swapped in (sensitivity, search: every other layer fake-quant) gives,
    evaluation after evaluation, the logits and links of a model converted for that evaluation alone: the layer
    of the previous evaluation is put back as the fake-quant layer it was, two layers at once work, and a layer
    that stays swapped takes the next table."""
    from runner.layer_swaps import LayerSwaps
    from runner.layers import fold_input_normalization

    model = _model("vgg", "mnist5k")
    calib = torch.rand(16, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    qcfg = QuantConfig(calib_batches=1, calib_batch_size=16, requant=requant)
    folded = fold_input_normalization(model.eval(), calib[:1])
    stats = calibrate(folded, calib, qcfg)
    names = list(quantized_layers(convert_model(folded, resolve("exact"), qcfg, stats, fake=True)))
    signed = {n: resolve("mul8s_1L2J") for n in names}
    fq = convert_model(folded, signed, qcfg, stats, fake=True, others="fakequant")
    swaps = LayerSwaps(fq, folded, qcfg, stats, "python", "auto")
    x = torch.rand(8, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    for layers, table in (([names[1]], "mul8s_1L2J"), ([names[4]], "mul8s_1L2J"), ([names[1], names[4]], "mul8s_1KX5"),
                          ([names[4]], "mul8s_1L2N"), ([names[-1]], "mul8s_1L2J")):
        mults = {**signed, **{n: resolve(table) for n in layers}}
        got = swaps.install(mults, layers)
        for n in layers:  # a reused LUT layer takes this evaluation's table, as build_models does
            got.get_submodule(n).set_multiplier(mults[n])
        fresh = convert_model(folded, mults, qcfg, stats, layers=layers, others="fakequant")
        assert [type(m) for m in quantized_layers(got).values()] == [type(m) for m in quantized_layers(fresh).values()]
        assert integer_links(got) == integer_links(fresh)
        with torch.no_grad():
            assert torch.equal(got(x), fresh(x)), (layers, table)
    # the reference model the swaps were copied from is untouched
    assert all(not isinstance(m, type(got.get_submodule(names[-1]))) for m in quantized_layers(fq).values())


def test_torchvision_resnet18_passes_8_of_its_17_relu_calls():
    """torchvision's BasicBlock calls one nn.ReLU after conv1 (conv1 -> conv2 hand-off: passed through) and after the
    residual add (clamped); the stem's ReLU feeds a max-pool read twice (no hand-off). The logits are those of the
    model whose ReLUs all clamp, bit for bit."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    fq, _ = approximate(model, "exact", x, QCFG, backend="python")
    assert len(integer_links(fq)) == 8
    clamping = _all_clamping(fq, CodesReLU, nn.ReLU)
    passed = []  # its ReLUs run in place, so a clamp returns its input too: a passed input is a marked one
    for m in fq.modules():
        if isinstance(m, CodesReLU):
            m.register_forward_pre_hook(lambda m, inp: passed.append(getattr(inp[0], CODES_ATTR, False)))
    with torch.no_grad():
        assert torch.equal(fq(x), clamping(x))
    assert len(passed) == 17 and sum(passed) == 8
