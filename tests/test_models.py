"""The model zoo: every model builds from its config on 1x28x28 and 3x32x32 data, folding BatchNorm and the
input normalisation keeps the fp32 outputs, conversion handles strided, padded, 1x1 and depthwise convs (exact
table == fake-quant), layers are chosen by module paths and globs, and a user's nn.Module converts too."""
import pytest
import torch
from torch import nn

from runner.errors import UserError
from runner.layers import approximate, integer_links, quantized_layers, select_layers
from runner.models import ZOO, LeNet5, build_model, fold_input_normalization
from runner.quant import QuantConfig, quant_layers
from tests.conftest import compose, has_cpp

SHAPES = {"mnist5k": (1, 28), "cifar10": (3, 32)}


class TinyNet(nn.Module):
    """A user's model for model=custom: takes whatever its config passes."""

    def __init__(self, num_classes: int = 10, width: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.head = nn.Linear(width * 14 * 14, num_classes)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Running statistics and affine parameters far from their initial 0/1, so a fold that drops them fails."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.3)
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.2)
    return model.eval()


def _model(name: str, data: str) -> nn.Module:
    cfg = compose("train", [f"model={name}", f"data={data}"])
    c, _ = SHAPES[data]
    mean, std = ((0.1307, 0.3081) if c == 1 else ((0.49, 0.48, 0.45), (0.25, 0.24, 0.26)))
    torch.manual_seed(0)
    return _randomize_bn(build_model(cfg.model, mean, std))


@pytest.mark.parametrize("data", list(SHAPES))
@pytest.mark.parametrize("name", list(ZOO))
def test_every_model_builds_from_its_config_and_folds_exactly(name, data):
    c, side = SHAPES[data]
    model = _model(name, data)
    x = torch.rand(4, c, side, side)
    out = model(x)
    assert out.shape == (4, 10)
    folded = fold_input_normalization(model, x)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    torch.testing.assert_close(folded(x), out, atol=2e-4, rtol=1e-4)
    # the first conv now reads raw pixels: its input is >= 0 (uint8 codes fit)
    first = next(iter(quant_layers(folded).values()))
    seen = []
    first.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    folded(x)
    assert seen[0].min() >= 0


def test_lenet5_checkpoint_keys_and_shapes_unchanged():
    model = LeNet5(mean=0.1307, std=0.3081)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {"normalize.mean": (), "normalize.std": (), "conv1.weight": (6, 1, 5, 5), "conv1.bias": (6,),
                      "conv2.weight": (16, 6, 5, 5), "conv2.bias": (16,), "fc1.weight": (120, 256), "fc1.bias": (120,),
                      "fc2.weight": (84, 120), "fc2.bias": (84,), "fc3.weight": (10, 84), "fc3.bias": (10,)}
    assert LeNet5(image_size=32, in_channels=3).fc1.in_features == 400  # the classic LeNet-5 on 32x32


def test_zoo_target_stays_out_of_the_checkpoint_key():
    from runner.train import weight_config

    key = weight_config(compose("train", ["model=resnet8"]))["model"]
    assert key == {"name": "resnet8", "num_classes": 10}
    custom = weight_config(compose("train", ["model=custom", "model._target_=tests.test_models.TinyNet"]))["model"]
    assert custom["_target_"] == "tests.test_models.TinyNet"


def test_resnet_layer_names_are_module_paths_and_globs_select_them():
    model = _model("resnet20", "cifar10")
    names = list(quant_layers(model))
    assert len(names) == 22 and names[0] == "conv1" and names[-1] == "fc"
    assert "layer2.0.shortcut.0" in names and "layer1.2.conv2" in names
    third = select_layers(model, ["layer3.*"])
    assert third == [n for n in names if n.startswith("layer3.")] and len(third) == 7
    assert select_layers(model, ["fc", "*.shortcut.*", "fc"]) == ["fc", "layer2.0.shortcut.0", "layer3.0.shortcut.0"]
    with pytest.raises(UserError, match="layer9"):
        select_layers(model, ["layer9.*"])


def _agreement(name: str, data: str, n: int = 48):
    c, side = SHAPES[data]
    model = _model(name, data)
    gen = torch.Generator().manual_seed(1)
    calib, x = torch.rand(64, c, side, side, generator=gen), torch.rand(n, c, side, side, generator=gen)
    fq, approx = approximate(model, "exact", calib, QuantConfig(calib_batches=1, calib_batch_size=64))
    with torch.no_grad():
        a, f = approx(x), fq(x)
    return a, f, approx


@pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension")
@pytest.mark.parametrize("name,data", [("resnet8", "cifar10"), ("mobilenetv2", "mnist5k"), ("vgg", "cifar10")])
def test_exact_table_agrees_with_fakequant(name, data):
    a, f, approx = _agreement(name, data)
    assert (a.argmax(1) == f.argmax(1)).all()
    torch.testing.assert_close(a, f, atol=2e-2 * f.abs().max().item(), rtol=0)
    kinds = {(m.groups > 1, tuple(m.weight.shape[2:]), tuple(m.stride)) for m in quantized_layers(approx).values()
             if hasattr(m, "groups")}
    if name == "mobilenetv2":
        assert (True, (3, 3), (2, 2)) in kinds and (False, (1, 1), (1, 1)) in kinds  # depthwise s2, 1x1


def test_custom_model_builds_converts_and_reports_bad_targets():
    cfg = compose("train", ["model=custom", "model._target_=tests.test_models.TinyNet", "+model.width=3"])
    model = build_model(cfg.model)
    assert isinstance(model, TinyNet) and model.body[0].out_channels == 3
    fq, approx = approximate(_randomize_bn(model), "exact", torch.rand(32, 1, 28, 28),
                             QuantConfig(calib_batches=1, calib_batch_size=32), backend="python")
    assert set(quantized_layers(approx)) == {"body.0", "head"}
    with pytest.raises(UserError, match="names no class"):
        build_model(compose("train", ["model=custom"]).model)
    with pytest.raises(UserError, match="cannot be imported"):
        build_model(compose("train", ["model=custom", "model._target_=no_such_pkg.Net"]).model)
    with pytest.raises(UserError, match="does not take"):
        build_model(compose("train", ["model=custom", "model._target_=tests.test_models.TinyNet",
                                      "+model.depth=3"]).model)


def test_per_layer_multipliers_take_dotted_layer_names():
    """Hydra's override grammar reads a dotted dict key as written: +multiplier.layers={layer1.0.conv1: x}."""
    from runner.multipliers import resolve_per_layer

    cfg = compose("compare", ["model=resnet8", "multiplier=exact",
                              "+multiplier.layers={layer1.0.conv1: mul8s_1L2J, layer3.0.shortcut.0: mul8s_1KV8}"])
    names = list(quant_layers(build_model(cfg.model)))
    per_layer = resolve_per_layer(cfg.multiplier, names)
    assert per_layer["layer1.0.conv1"].name == "mul8s_1L2J" and per_layer["layer3.0.shortcut.0"].name == "mul8s_1KV8"
    assert per_layer["conv1"].name.startswith("exact")


def test_accumulator_check_names_the_layer_by_its_path():
    """A table whose products could overflow int32 over a layer's K is refused naming that layer's path."""
    from runner.multipliers.core import Multiplier

    model = _model("resnet8", "mnist5k")
    wide = Multiplier("wide", True, torch.full((256, 256), 1 << 24, dtype=torch.int32))  # K=144 overflows
    with pytest.raises(UserError, match=r"layer layer1\.0\.conv1: sums K=144"):
        approximate(model, {"conv1": "exact", "layer1.0.conv1": wide}, torch.rand(8, 1, 28, 28),
                    QuantConfig(calib_batches=1, calib_batch_size=8), backend="python")


@pytest.mark.cuda
@pytest.mark.parametrize("name,data", [
    ("resnet20", "cifar10"), ("vgg", "mnist5k"),
    ("mobilenetv2", "cifar10"),
])
def test_cuda_zoo_matches_cpp(name, data):
    """On the GPU the zoo's layers (1x1, stride 2, depthwise, 3-channel stems), their integer hand-offs, residual
    adds and the global average pool give the cpp backend's logits bit for bit."""
    from runner._ext import backend_status

    if backend_status().get("cuda") != "available" or not torch.cuda.is_available():
        pytest.skip("needs the CUDA extension and a GPU")
    c, side = SHAPES[data]
    model = _model(name, data)
    gen = torch.Generator().manual_seed(1)
    calib, x = torch.rand(64, c, side, side, generator=gen), torch.rand(32, c, side, side, generator=gen)
    qcfg = QuantConfig(calib_batches=1, calib_batch_size=64)
    fq, cpu = approximate(model, "mul8s_1L2J", calib, qcfg, backend="cpp")
    _, gpu = approximate(model, "mul8s_1L2J", calib, qcfg, backend="cuda")
    assert integer_links(cpu) and integer_links(gpu) == integer_links(cpu)  # the integer hand-offs run too
    with torch.no_grad():
        want, got = cpu(x), gpu.to("cuda")(x.cuda()).cpu()
    assert torch.equal(got, want)
