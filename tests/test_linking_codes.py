"""Codes handed on alone (runner.linking.codes_alone): inside a forward, a LUT layer whose output only its linked
consumer reads (through steps that return it unchanged) gives that consumer requantize_codes' codes and no float
tensor. The logits are those of the float hand-offs bit for bit; a layer called by itself, a hook that could see
the value, autograd, or a fake-quant consumer get floats as before."""
import pytest
import torch
from torch import nn

import runner.layers
from runner.layers import approximate, quantized_layers
from runner.linking import HANDED_ATTR, handed_float
from tests.conftest import has_cpp, recording
from tests.test_linking import QCFG, _converted
from tests.test_models import SHAPES

BACKENDS = ["python", pytest.param("cpp", marks=pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension"))]


def _input(data, n=8, seed=3):
    c, side = SHAPES[data]
    return torch.rand(n, c, side, side, generator=torch.Generator().manual_seed(seed))


def _handed():
    """[(consumer's name, the placeholder its producer handed)], one a hand-off of codes alone while the block runs."""
    return recording(runner.layers, "hand_codes", lambda args, kwargs, out: (args[1].layer_name, out))


def _forward(model, x, float_hand_offs=False, grad=False):
    """(logits, names of the layers that were handed codes alone). float_hand_offs: a global forward hook (a no-op)
    is registered, which any hook-free path must decline."""
    hook = nn.modules.module.register_module_forward_hook(lambda m, a, o: None) if float_hand_offs else None
    try:
        with _handed() as handed, torch.set_grad_enabled(grad):
            return model(x), [name for name, _ in handed]
    finally:
        if hook is not None:
            hook.remove()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,data,want", [
    ("resnet8", "cifar10", 3),          # each block's conv1 -> ReLU -> conv2
    ("mobilenetv2", "mnist5k", 13),     # expand -> ReLU6 -> depthwise -> project, but the first block's expand
    ("vgg", "mnist5k", 4),              # conv -> ReLU -> conv, linear -> ReLU -> linear; not through a max-pool
])
def test_codes_alone_give_the_float_hand_offs_logits(backend, name, data, want):
    _, approx = _converted(name, data, "mul8s_1L2J", backend)
    x = _input(data)
    got, handed = _forward(approx, x)
    ref, none = _forward(approx, x, float_hand_offs=True)
    assert len(handed) == want and none == []
    assert torch.equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torchvision_models_hand_codes_alone_with_the_same_logits(backend):
    """torchvision ResNet-18 (its BasicBlocks' conv1 -> in-place ReLU -> conv2) and MobileNetV2 (expand -> BN folded
    -> ReLU6 -> depthwise -> ReLU6 -> project, and a project to the next expand where no residual add reads it)."""
    torchvision = pytest.importorskip("torchvision")
    x = torch.rand(2, 3, 48, 48, generator=torch.Generator().manual_seed(6))
    for ctor, want in ((torchvision.models.resnet18, 8), (torchvision.models.mobilenet_v2, 36)):
        torch.manual_seed(0)
        _, approx = approximate(ctor(num_classes=10).eval(), "mul8s_1L2J", x, QCFG, backend=backend)
        got, handed = _forward(approx, x)
        ref, _ = _forward(approx, x, float_hand_offs=True)
        assert len(handed) == want and torch.equal(got, ref), ctor.__name__


def test_a_layer_called_by_itself_a_hook_or_autograd_gets_floats():
    _, approx = _converted("resnet8", "cifar10", "mul8s_1L2J")
    conv1 = approx.layer1[0].conv1
    x = _input("cifar10")
    ref, all_three = _forward(approx, x)
    with torch.no_grad():
        alone = conv1(torch.rand(8, conv1.weight.shape[1], 32, 32))  # not inside a forward of the model
    assert len(all_three) == 3 and not hasattr(alone, HANDED_ATTR) and alone.stride()[-1] == 1
    seen = []
    conv1.register_forward_hook(lambda m, a, out: seen.append(out))
    got, handed = _forward(approx, x)
    assert torch.equal(got, ref) and handed == ["layer2.0.conv2", "layer3.0.conv2"]
    assert len(seen) == 1 and not hasattr(seen[0], HANDED_ATTR)  # the hooked producer handed floats
    _, handed = _forward(approx, x, grad=True)
    assert handed == []


def test_a_placeholder_never_reaches_another_layer_and_gives_its_floats_back():
    _, approx = _converted("resnet8", "cifar10", "mul8s_1L2J")
    x = _input("cifar10")
    with _handed() as captured, torch.no_grad():
        approx(x)
    placeholder, consumer = dict(captured)["layer2.0.conv2"], quantized_layers(approx)["layer2.0.conv2"]
    assert placeholder.stride() == (0, 0, 0, 0)  # no memory behind it
    codes = getattr(placeholder, HANDED_ATTR)[0]
    assert torch.equal(handed_float(placeholder), codes.float() * consumer.act_scale)
    other = quantized_layers(approx)["layer3.0.conv2"]
    with torch.no_grad(), pytest.raises(RuntimeError, match="other than their consumer"):
        other(placeholder)


@pytest.mark.cuda
def test_cuda_hand_offs_eager_and_graphed_give_the_cpu_logits():
    """On a GPU (requantize_codes' vector and scalar kernels: planes of 32 x 32 and 7 x 7), eager and replayed from
    a CUDA graph (whose capture runs without the model's hooks: linking.in_forward keeps the hand-offs): the
    logits of the float hand-offs, and the cpp backend's, bit for bit."""
    from runner.graphs import GraphedForward

    torchvision = pytest.importorskip("torchvision")
    for model, x in ((_converted("resnet8", "cifar10", "mul8s_1L2J", "cpp")[1], _input("cifar10")),
                     (None, torch.rand(4, 3, 56, 56, generator=torch.Generator().manual_seed(7)))):
        if model is None:
            torch.manual_seed(0)
            model = approximate(torchvision.models.mobilenet_v2(num_classes=10).eval(), "mul8s_1L2J", x, QCFG,
                                backend="cpp")[1]
        cpu, _ = _forward(model, x, float_hand_offs=True)
        for layer in quantized_layers(model).values():
            layer.backend = "cuda"
        model, xc = model.cuda(), x.cuda()
        got, handed = _forward(model, xc)
        ref, _ = _forward(model, xc, float_hand_offs=True)
        graphed = GraphedForward(model)
        with _handed() as in_capture:  # two warm-up forwards and the capture, then replays
            replayed = [graphed(xc) for _ in range(2)]
        assert handed and len(in_capture) == 3 * len(handed) and not graphed.failure
        assert all(torch.equal(t.cpu(), cpu) for t in (got, ref, *replayed))
