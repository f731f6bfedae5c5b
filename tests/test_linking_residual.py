"""Residual blocks' ends in their last LUT layer (runner.linking.fuse_residual_ends): at inference the block's
add and ReLU run in that layer's dequantize, with the logits of the blocks' own forwards bit for bit; a hook that
could see the values between, autograd, a fake-quant layer or a block of another class keep the block's forward.
Likewise a layer with no LUT consumer whose output a ReLU reads next (a stem) applies that ReLU itself."""
import contextlib
import copy
import io

import pytest
import torch
from torch import nn

import runner.ops
import runner.ops_autograd
from runner.layers import approximate, consumer_links, quantized_layers
from runner.linking import SIDE_ATTR, fuse_residual_ends
from tests.conftest import has_cpp, recording
from tests.test_linking import QCFG, _converted
from tests.test_linking_codes import _input

BACKENDS = ["python", pytest.param("cpp", marks=pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension"))]


@contextlib.contextmanager
def _dequantizes(keep):
    """The dequantizes keep(residual, relu, output) picks while the block runs: dequantize's calls and those of the
    conv ops that end in one (lut_conv2d_dequantize, as the conv layers call it)."""
    def picker(at):  # where residual is among the positional arguments (relu follows it)
        def pick(args, kwargs, out):
            residual = args[at] if len(args) > at else kwargs.get("residual")
            relu = args[at + 1] if len(args) > at + 1 else kwargs.get("relu", False)
            return keep(residual, relu, out)
        return pick
    with recording(runner.ops, "dequantize", picker(4)) as plain, \
            recording(runner.ops_autograd, "lut_conv2d_dequantize", picker(10)) as convs:
        yield _Both(plain, convs)


class _Both:
    """Two recordings read as one list."""
    def __init__(self, *parts):
        self.parts = parts

    def __len__(self):
        return sum(map(len, self.parts))

    def __iter__(self):
        return iter([x for p in self.parts for x in p])

    def __eq__(self, other):
        return list(self) == list(other)


def _fused():
    """The dequantizes given a residual (a block's end fused) while the block runs."""
    return _dequantizes(lambda residual, relu, acc: tuple(acc.shape) if residual is not None else None)


def _unfused(model: nn.Module) -> nn.Module:
    """A copy whose blocks are their original classes again: each block's own forward, the codes hand-offs kept."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if type(m).__name__.startswith("Fused"):
            m.__class__ = type(m).__mro__[2]  # (fused, _FusedEnd, the original, ...)
    return model


def _forward(model, x, grad=False):
    with _fused() as calls, torch.set_grad_enabled(grad):
        return model(x), len(calls)


def _side_uses():
    """The layers that read the codes a block's end wrote for them (side codes) while the block runs."""
    def keep(args, kwargs, codes):
        x, consumer = args
        return consumer.layer_name if codes is not None and getattr(x, SIDE_ATTR, None) is not None else None
    return recording(runner.layers, "handed_codes", keep)


def _torchvision_models():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.resnet import Bottleneck, ResNet
    return ((lambda: torchvision.models.resnet18(num_classes=10), 8),
            (lambda: ResNet(Bottleneck, [1, 2, 1, 1], num_classes=10), 5),
            (lambda: torchvision.models.mobilenet_v2(num_classes=10), 10))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_ends_give_the_blocks_own_logits(backend):
    """The zoo's ResNet-8 (BasicBlock, shortcut a Sequential: empty or conv + folded BN) and MobileNetV2 (the add
    without a ReLU), torchvision's ResNet-18 (BasicBlock), a Bottleneck ResNet (downsample or none) and MobileNetV2:
    every residual block's end fused, the same bits as the blocks' own forwards (with the codes hand-offs either
    way) and as the model with nothing fused or handed on; the next block's first layer reads the codes the end
    wrote for it."""
    x = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(6))
    cases = [(lambda: _converted("resnet8", "cifar10", "mul8s_1L2J", backend)[1], _input("cifar10"), 3),
             (lambda: _converted("mobilenetv2", "mnist5k", "mul8s_1L2J", backend)[1], _input("mnist5k"), 4)]
    for ctor, want in _torchvision_models():
        torch.manual_seed(0)
        cases.append((lambda ctor=ctor: approximate(ctor().eval(), "mul8s_1L2J", x, QCFG, backend=backend)[1], x, want))
    side_want = [0, 3, 4, 1, 10]  # blocks a Sequential runs right after a fused one: their first layers' codes
    for (build, inp, want), side in zip(cases, side_want):
        approx = build()
        with _side_uses() as used:
            got, fused = _forward(approx, inp)
        assert len(used) == side, used
        ref, none = _forward(_unfused(approx), inp)
        hook = nn.modules.module.register_module_forward_hook(lambda m, a, o: None)  # nothing fused nor handed on
        try:
            plain, also_none = _forward(approx, inp)
        finally:
            hook.remove()
        assert (fused, none, also_none) == (want, 0, 0)
        assert torch.equal(got, ref) and torch.equal(got, plain)


def test_a_hook_autograd_or_fake_quant_keeps_the_blocks_forward():
    fq, approx = _converted("resnet8", "cifar10", "mul8s_1L2J")
    x = _input("cifar10")
    ref, fused = _forward(approx, x)
    conv2 = approx.layer2[0].conv2
    seen = []
    handle = conv2.register_forward_hook(lambda m, a, out: seen.append(out))
    got, fused_hooked = _forward(approx, x)
    handle.remove()
    assert torch.equal(got, ref) and (fused, fused_hooked) == (3, 2)
    assert len(seen) == 1 and (seen[0] < 0).any()  # conv2's own output, before the add and the ReLU
    handle = approx.layer1[0].relu.register_forward_hook(lambda m, a, out: None)
    assert _forward(approx, x)[1] == 2
    handle.remove()
    assert _forward(fq, x)[1] == 0  # fake-quant layers take no residual; their blocks run as they were
    _, mobile = _converted("mobilenetv2", "mnist5k", "mul8s_1L2J")
    xm = _input("mnist5k")
    ref_m, fused_m = _forward(mobile, xm)
    mobile.blocks[2].project.register_forward_hook(lambda m, a, out: seen.append(out))  # a container passed over
    got_m, fused_hooked_m = _forward(mobile, xm)
    assert torch.equal(got_m, ref_m) and (fused_m, fused_hooked_m) == (4, 3) and len(seen) == 2

    # autograd: the block's sum and ReLU in torch, the same values and gradients as the blocks' own forwards
    unfused = _unfused(approx)
    for m in (approx, unfused):
        m.requires_grad_(True)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [_forward(m, xi, grad=True) for m, xi in zip((approx, unfused), xs)]
    assert outs[0][1] == 0 and torch.equal(outs[0][0], outs[1][0])
    for out, _ in outs:
        out.square().sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(conv2.weight.grad, unfused.layer2[0].conv2.weight.grad)


def test_links_save_load_and_other_block_classes_are_unchanged():
    """fx traces the blocks' own forwards (the same consumer links); a saved model loads with its fused classes;
    a block of a subclass with a forward of its own is not swapped."""
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.resnet import BasicBlock

    _, approx = _converted("resnet8", "cifar10", "mul8s_1L2J")
    assert consumer_links(approx) == consumer_links(_unfused(approx))
    x = _input("cifar10")
    buf = io.BytesIO()
    torch.save(approx, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.layer1[0]) is type(approx.layer1[0])
    assert torch.equal(_forward(loaded, x)[0], _forward(approx, x)[0])

    class Mine(BasicBlock):
        def forward(self, x):
            return super().forward(x) * 2

    model = torchvision.models.resnet18(num_classes=10)
    model.layer1[0] = Mine(64, 64)
    fuse_residual_ends(model)
    assert type(model.layer1[0]) is Mine and type(model.layer1[1]).__name__.startswith("Fused")
    assert type(model.layer1[1]).__mro__[2] is BasicBlock


def test_a_residual_of_another_shape_is_broadcast_as_the_add_would():
    _, approx = _converted("resnet8", "cifar10", "mul8s_1L2J")
    conv2 = approx.layer1[0].conv2
    inp = torch.rand(2, conv2.weight.shape[1], 8, 8, generator=torch.Generator().manual_seed(2))
    residual = torch.randn(1, conv2.weight.shape[0], 1, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(conv2(inp, residual=residual, relu=True), torch.relu(conv2(inp) + residual))
        assert torch.equal(conv2(inp, residual=residual), conv2(inp) + residual)
        for layer in quantized_layers(approx).values():
            assert getattr(layer, "lut_layer", False)


@pytest.mark.cuda
def test_cuda_fused_ends_eager_and_graphed_give_the_cpu_logits():
    """On a GPU (dequantize's vector kernel at 32 x 32 and 16 x 16 planes, the scalar one at 7 x 7), eager and
    replayed from a CUDA graph: the blocks' own logits on the CPU, bit for bit."""
    from runner.graphs import GraphedForward

    x = torch.rand(4, 3, 56, 56, generator=torch.Generator().manual_seed(7))
    models = [(_converted("resnet8", "cifar10", "mul8s_1L2J", "cpp")[1], _input("cifar10"))]
    for ctor, _ in _torchvision_models():
        torch.manual_seed(0)
        models.append((approximate(ctor().eval(), "mul8s_1L2J", x, QCFG, backend="cpp")[1], x))
    for model, inp in models:
        cpu, _ = _forward(_unfused(model), inp)
        for layer in quantized_layers(model).values():
            layer.backend = "cuda"
        model, xc = model.cuda(), inp.cuda()
        got, fused = _forward(model, xc)
        graphed = GraphedForward(model)
        replayed = [graphed(xc) for _ in range(2)]
        assert fused and not graphed.failure
        assert all(torch.equal(t.cpu(), cpu) for t in (got, *replayed))


def _relu_ends(model, x):
    """(logits, the dequantizes that applied a layer's ReLU end, how often a ReLU module computed a ReLU)."""
    relu_only = _dequantizes(lambda residual, relu, acc: tuple(acc.shape) if relu and residual is None else None)
    with relu_only as ends, recording(torch.nn.functional, "relu", lambda a, k, o: 1) as relus, torch.no_grad():
        return model(x), ends, len(relus)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stem_applies_its_relu_in_its_last_pass(backend):
    """The stems of the zoo's ResNet-8 (conv, folded BN, ReLU, then read by a block's conv1 and its shortcut) and of
    torchvision's ResNet-18 (then a max-pool): the ReLU in the stem conv's dequantize, which that ReLU passes on; the
    logits of the model with nothing fused; a hook on the ReLU, or the conv called by itself, and it runs apart."""
    torchvision = pytest.importorskip("torchvision")
    x = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    tv = approximate(torchvision.models.resnet18(num_classes=10).eval(), "mul8s_1L2J", x, QCFG, backend=backend)[1]
    for approx, inp in ((_converted("resnet8", "cifar10", "mul8s_1L2J", backend)[1], _input("cifar10")), (tv, x)):
        got, ends, relus = _relu_ends(approx, inp)
        hook = nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
        try:
            ref, none, _ = _relu_ends(approx, inp)
        finally:
            hook.remove()
        # every ReLU module passed its input on: the stem's (applied by the conv), the blocks' (codes, fused ends)
        assert len(ends) == 1 and relus == 0 and none == [] and torch.equal(got, ref)
        seen = []
        handle = approx.relu.register_forward_pre_hook(lambda m, a: seen.append(bool((a[0] < 0).any())))
        hooked, ends_hooked, _ = _relu_ends(approx, inp)
        handle.remove()
        assert ends_hooked == [] and torch.equal(hooked, ref) and seen == [True]  # the ReLU saw the conv's output
        with torch.no_grad():
            alone = approx.conv1(inp)
        assert (alone < 0).any()  # called by itself, the conv's own output


def test_side_codes_are_read_only_by_their_layer_and_only_while_unchanged():
    """A block's output changed in place after its end wrote the next layer's codes (a forward hook here): that
    layer quantizes the output itself; the logits stay those of the model with nothing fused. Another layer handed
    the output does not take the codes."""
    torchvision = pytest.importorskip("torchvision")
    x = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    approx = approximate(torchvision.models.resnet18(num_classes=10).eval(), "mul8s_1L2J", x, QCFG, backend="python")[1]
    with _side_uses() as used:
        ref, _ = _forward(approx, x)
    assert "layer1.1.conv1" in used
    handle = approx.layer1[0].register_forward_hook(lambda m, a, out: out.mul_(1.0))  # same values, a new version
    with _side_uses() as used_after:
        got, _ = _forward(approx, x)
    handle.remove()
    assert torch.equal(got, ref) and "layer1.1.conv1" not in used_after and len(used_after) == len(used) - 1
    seen = []
    handle = approx.layer1[0].register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        approx(x)
    handle.remove()
    out = seen[0]
    assert runner.layers.handed_codes(out, approx.layer1[1].conv1) is not None
    assert runner.layers.handed_codes(out, approx.layer2[0].conv1) is None
