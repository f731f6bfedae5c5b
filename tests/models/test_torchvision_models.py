"""model=torchvision: names, weights (a state dict file, the hub cache of the weights API), the normalisation
folded into the first conv, the class count, the held-apart calibration part, and compare end to end."""
import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from runner.errors import UserError
from runner.models import build_model, fold_input_normalization
from runner.models.torchvision_models import build, check_arch, hub_file, weights_enum
from tests.conftest import compose, has_cpp

TV = "runner.models.torchvision_models.build"


def tv_cfg(arch="resnet18", weights=None, **extra):
    return OmegaConf.create({"_target_": TV, "name": "torchvision", "arch": arch, "weights": weights,
                             "approx_layers": None, "other_layers": "fp32", **extra})


def test_every_classification_model_by_name_and_nearest_names_for_a_typo():
    assert check_arch("convnext_tiny") == "convnext_tiny"
    with pytest.raises(UserError, match="resnet18"):
        check_arch("resnt18")
    with pytest.raises(UserError, match="IMAGENET1K_V1"):
        weights_enum("resnet18", "IMAGENET1K_V9")


def test_keeps_torchvisions_layer_names_with_a_normalize_in_front():
    torch.manual_seed(0)
    m = build("resnet18", num_classes=10)
    names = [n for n, _ in m.named_modules()]
    assert "conv1" in names and "fc" in names and "input_norm" in names
    x = torch.rand(2, 3, 32, 32)
    plain = torch.nn.Module.__getattribute__(m, "__class__").__mro__[2]  # torchvision's ResNet
    with torch.no_grad():
        expect = plain.forward(m, (x - m.input_norm.mean.view(1, -1, 1, 1)) / m.input_norm.std.view(1, -1, 1, 1))
        assert torch.equal(m(x), expect)


def test_weights_from_a_state_dict_file(tmp_path):
    torch.manual_seed(0)
    src = build("resnet18", num_classes=10)
    path = tmp_path / "r18.pt"
    torch.save({k: v for k, v in src.state_dict().items() if not k.startswith("input_norm")}, path)
    got = build("resnet18", weights=str(path), num_classes=10)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), got.state_dict().values()))
    with pytest.raises(UserError, match="does not fit"):  # the wrong class count
        build("resnet18", weights=str(path))
    with pytest.raises(UserError, match="does not fit"):  # the wrong arch
        build("resnet34", weights=str(path), num_classes=10)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(UserError, match="not a readable state dict"):
        build("resnet18", weights=str(bad), num_classes=10)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(UserError, match="not a state dict"):
        build("resnet18", weights=str(tmp_path / "list.pt"), num_classes=10)
    with pytest.raises(UserError, match="no such file"):
        build("resnet18", weights=str(tmp_path / "missing.pt"), num_classes=10)


def test_weights_enum_from_the_hub_cache_and_the_path_when_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)
    enum = weights_enum("resnet18", "DEFAULT")
    where = hub_file(enum)
    assert where == tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    with pytest.raises(UserError, match=str(where)):
        build("resnet18", weights="IMAGENET1K_V1")
    torch.manual_seed(1)
    random = build("resnet18")  # 1000 classes, as the enum's file
    where.parent.mkdir(parents=True)
    torch.save({k: v for k, v in random.state_dict().items() if not k.startswith("input_norm")}, where)
    got = build("resnet18", weights="DEFAULT")
    assert torch.equal(got.fc.weight, random.fc.weight)
    assert got.input_norm.mean.tolist() == pytest.approx([0.485, 0.456, 0.406])


@pytest.mark.parametrize("arch", ["resnet18", pytest.param("mobilenet_v3_small", marks=pytest.mark.slow),
                                  pytest.param("efficientnet_b0", marks=pytest.mark.slow),
                                  pytest.param("convnext_tiny", marks=pytest.mark.slow)])
def test_normalisation_folds_into_the_first_conv(arch):
    torch.manual_seed(0)
    m = build_model(tv_cfg(arch, num_classes=10)).eval()
    x = torch.rand(3, 3, 32, 32)
    folded = fold_input_normalization(m, x[:1])
    assert not any(type(mod).__name__ == "Normalize" for mod in folded.modules())  # it went into the conv
    with torch.no_grad():
        a, b = m(x), folded(x)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-30


class _Data:
    num_classes = 10
    input_shape = (3, 32, 32)


def test_class_count_of_model_and_data_must_agree():
    from runner.train import check_classes

    cfg = OmegaConf.create({"model": tv_cfg("resnet18", "DEFAULT"), "data": {"name": "tiny"}})
    with pytest.raises(UserError, match="1000 outputs.*10 classes"):
        check_classes(cfg, _Data())
    cfg = OmegaConf.create({"model": tv_cfg("resnet18"), "data": {"name": "tiny"}})
    with pytest.raises(UserError, match=r"\+model.num_classes=10"):
        check_classes(cfg, _Data())
    cfg.model.num_classes = 10
    check_classes(cfg, _Data())
    gray = _Data()
    gray.input_shape = (1, 28, 28)
    with pytest.raises(UserError, match="3 channels"):
        check_classes(cfg, gray)


def tiny3(n_train=0, n_test=60, has_train=False, seed=0, size=32):
    from runner.data import Dataset

    g = torch.Generator().manual_seed(seed)
    classes = tuple(f"n{i:08d}" for i in range(10))
    y = torch.arange(n_test) % 10
    return Dataset("tiny3", torch.rand(n_train, 3, size, size, generator=g), torch.arange(n_train) % 10,
                   torch.rand(n_test, 3, size, size, generator=g), y, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225),
                   "generated", classes=classes, has_train=has_train)


def test_calibration_part_held_apart_when_there_is_no_training_split():
    from runner.train import held_apart

    data = tiny3(n_test=200)
    data = dataclasses.replace(data, test_x=torch.arange(200.).view(200, 1, 1, 1).expand(200, 3, 2, 2).clone())
    cfg = OmegaConf.create({"data": {"calib_images": 20}})
    a, b = held_apart(data, cfg), held_apart(data, cfg)
    calib, rest = a.train_x[:, 0, 0, 0].long(), a.test_x[:, 0, 0, 0].long()
    assert len(calib) == 20 and len(rest) == 180 and not set(calib.tolist()) & set(rest.tolist())
    assert torch.bincount(a.train_y, minlength=10).tolist() == [2] * 10  # every class
    assert torch.equal(a.train_x, b.train_x)  # seeded
    assert torch.equal(a.train_y, data.test_y[calib]) and torch.equal(a.test_y, data.test_y[rest])
    small = held_apart(tiny3(n_test=50), OmegaConf.create({"data": {"calib_images": 1000}}))
    assert len(small.train_y) == 10  # a small set gives a fifth at most
    with_train = tiny3(n_train=20, has_train=True)
    assert held_apart(with_train, cfg) is with_train


@pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension")
def test_compare_uses_given_weights_as_the_baseline_and_exact_matches_fakequant(tmp_path, capsys):
    """compare with model.weights=<a state dict> on a generated ImageFolder of val/ only (16x16 crops): nothing
    trained, the calibration part held apart, the exact table's predictions equal fake-quant's on every image
    measured."""
    from runner import compare, session, train
    from tests.data.imagefolder_fixture import write_imagefolder

    write_imagefolder(tmp_path / "tree", per_class=3, splits=("val",), corrupt=False)
    torch.manual_seed(0)
    src = build("resnet18", num_classes=10)
    wpath = tmp_path / "r18.pt"
    torch.save(src.state_dict(), wpath)
    overrides = ["model=torchvision", "model.arch=resnet18", f"model.weights={wpath}", "+model.num_classes=10",
                 "data=imagefolder", f"data.root={tmp_path / 'tree'}", "data.resize=20", "data.crop=16",
                 "data.workers=1", "backend=cpp", "multiplier=exact", "eval.repeats=1", "eval.warmup=0",
                 "quant.calib_batches=1"]
    session.reset()
    try:
        cfg = compose("compare", overrides, tmp_path)
        out = tmp_path / "run"
        out.mkdir()
        result = compare.run(cfg, out)
        # what it will evaluate and an estimate, before the first evaluation's progress line
        said = capsys.readouterr().out
        assert said.index("compare: 3 evaluations (pytorch x2, fakequant x2, approx x2) of 20 images, about ") < \
            said.index("compare exact_s on cpu: 1/3")
        rows = {r["path"]: r for r in result["rows"]}
        assert rows["approx"]["agreement_fakequant"] == 1.0
        assert rows["approx"]["n_images"] == 20  # 30 less one a class held apart held apart for calibration
        assert rows["pytorch"]["model"] == "torchvision.resnet18"
        assert not list((tmp_path / "checkpoints").glob("*.pt"))  # nothing trained (the data cache lives there)
        # another weights file is another row identity
        torch.save(build("resnet18", num_classes=10).state_dict(), tmp_path / "other.pt")
        other = compose("compare", [*overrides[:2], f"model.weights={tmp_path / 'other.pt'}", *overrides[3:]],
                        tmp_path)
        assert compare.plan_run(other).row_keys["pytorch"] != compare.plan_run(cfg).row_keys["pytorch"]
        said = train.run(cfg, out)
        assert said["pretrained"] == str(wpath) and "nothing to train" in capsys.readouterr().out
    finally:
        session.reset()


def resnet18_and_logits(images):
    """A seeded 10-class torchvision resnet18 in eval mode, 16x16 inputs, and its whole forward's logits."""
    torch.manual_seed(0)
    model = build("resnet18", num_classes=10).eval()
    x = torch.rand(images, 3, 16, 16)
    with torch.no_grad():
        return model, x, model(x)


def test_prefix_cache_gives_the_whole_models_logits_and_runs_the_prefix_once(monkeypatch):
    """A torchvision model started at a layer from its kept prefix: the logits equal a whole forward bit for bit,
    the layers before that block do not run again, and past the memory budget nothing is kept (still equal)."""
    from runner.session import Prefix, Session

    model, x, whole = resnet18_and_logits(12)
    calls = []
    model.conv1.register_forward_hook(lambda *a: calls.append(1))
    sess = Session()
    first = sess.logits_from(model, x, 4, torch.device("cpu"), "layer3.0.conv2", Prefix("before-layer3"))
    n_first = len(calls)
    again = sess.logits_from(model, x, 4, torch.device("cpu"), "layer3.0.conv2", Prefix("before-layer3"))
    assert torch.equal(first, whole) and torch.equal(again, whole)
    assert len(calls) == n_first  # the kept inputs of layer3.0: conv1 did not run again
    monkeypatch.setenv("APPROX_RUN_PREFIX_CACHE_MB", "0.001")
    small = Session()
    assert torch.equal(small.logits_from(model, x, 4, torch.device("cpu"), "layer2.1.conv1", Prefix("k")), whole)
    assert not small._prefixes  # over the budget: recomputed, not kept


def test_a_later_layer_continues_the_kept_prefix_of_an_earlier_one():
    from runner.session import Prefix, Session

    model, x, whole = resnet18_and_logits(12)
    runs = {"conv1": 0, "layer1.0": 0, "layer2.0": 0}
    for name in runs:
        model.get_submodule(name).register_forward_hook(lambda *a, n=name: runs.__setitem__(n, runs[n] + 1))
    sess, cpu = Session(), torch.device("cpu")
    sess._chain_ok = lambda *a: True  # its check runs the model too (tested above); these counts are the batches'
    before = (("conv1", "fp32", None), ("layer1.0.conv1", "fp32", None))
    assert torch.equal(sess.logits_from(model, x, 4, cpu, "layer1.0.conv2", Prefix("m", before[:1])), whole)
    assert runs == {"conv1": 3, "layer1.0": 3, "layer2.0": 3}
    # layer2's input comes from layer1.0's kept one: the stem does not run again, layer1.0 does (it is between)
    assert torch.equal(sess.logits_from(model, x, 4, cpu, "layer2.0.conv1", Prefix("m", before)), whole)
    assert runs == {"conv1": 3, "layer1.0": 6, "layer2.0": 6}
    # other layers before it (another base, or a `before` that does not begin with the kept one's): from the input
    assert torch.equal(sess.logits_from(model, x, 4, cpu, "layer3.0.conv1", Prefix("other", before)), whole)
    assert runs == {"conv1": 6, "layer1.0": 9, "layer2.0": 9}
    changed = (("conv1", "fakequant", True),) + before[1:]
    assert torch.equal(sess.logits_from(model, x, 4, cpu, "layer2.0.conv2", Prefix("m", changed)), whole)
    assert runs["conv1"] == 9


def test_a_model_whose_forward_is_no_chain_runs_whole():
    from runner.models import chain_matches

    class Skip(torch.nn.Module):  # its forward adds its input back: not the chain of its children
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 3, 1)
            self.b = torch.nn.Conv2d(3, 3, 1)

        def forward(self, x):
            return self.b(self.a(x)) + x

    assert not chain_matches(Skip(), torch.rand(2, 3, 4, 4), "b")


def test_the_chain_is_checked_once_per_model(monkeypatch):
    """The check that a model's forward is its stages' chain (two passes over a batch) runs once per model, not
    once per layer a sensitivity table starts at; a layer in no stage still runs the model whole."""
    import runner.session as session_mod
    from runner.session import Prefix, Session

    model, x, whole = resnet18_and_logits(8)
    checks = []
    real = session_mod.chain_matches
    monkeypatch.setattr(session_mod, "chain_matches", lambda *a: checks.append(a[2]) or real(*a))
    sess, cpu = Session(), torch.device("cpu")
    for start in ("layer1.0.conv2", "layer2.0.conv1", "layer3.1.conv2", "fc"):
        assert torch.equal(sess.logits_from(model, x, 4, cpu, start, Prefix("m", ((start, "fp32", None),))), whole)
    assert checks == ["layer1.0.conv2"]
    assert not sess._chain_ok(model, x[:4], "no.such.layer", cpu)


@pytest.mark.parametrize("arch,layer", [("resnet18", "layer2.0.conv1"), ("mobilenet_v3_small", "features.4.block.0.0")])
def test_converted_models_are_their_stages_chain(arch, layer):
    """A sensitivity or search starts converted models at a layer from the kept prefix only where the stages'
    chain is the model's forward: it must be for converted torchvision models too (their classifier's Linear is
    a converted layer, before which the chain flattens), or every evaluation runs the whole model."""
    from runner.layers import approximate
    from runner.models import chain_matches

    torch.manual_seed(0)
    model = build(arch, num_classes=10).eval()
    x = torch.rand(4, 3, 32, 32)
    fq, approx = approximate(model, "exact", x, backend="python")
    assert chain_matches(model, x, layer) and chain_matches(fq, x, layer) and chain_matches(approx, x, layer)
