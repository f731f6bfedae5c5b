"""data=imagefolder on a generated tree (tests/data/imagefolder_fixture.py): the transform against torchvision's,
the on-disk cache (hit, digest, atomicity), damaged files, data.limit, and the lazily read images."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from runner.data import imagefolder, load_dataset
from runner.data.dataset import Images, RandomResizedCropFlip
from runner.errors import UserError
from tests.data.imagefolder_fixture import CLASSES, write_imagefolder

SMALL = {"resize": 40, "crop": 32}  # the transform at a small size: the same code path, a fraction of the time


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagefolder")
    bad = write_imagefolder(root)
    return root, bad


def cfg_of(root, cache, **kw):
    return OmegaConf.create({"name": "imagefolder", "root": str(root), "cache_dir": str(cache), "workers": 1,
                             **SMALL, **kw})


@pytest.fixture
def decodes(monkeypatch):
    """The images decoded in this test (workers=1 decodes in this process)."""
    seen = []
    real = imagefolder.decode

    def counting(path, *a):
        seen.append(path)
        return real(path, *a)
    monkeypatch.setattr(imagefolder, "decode", counting)
    return seen


def test_pixels_equal_torchvision_transforms(tree, tmp_path):
    from PIL import Image
    from torchvision import transforms as T

    root, bad = tree
    data = load_dataset(cfg_of(root, tmp_path, skip_bad=True))
    assert data.classes == CLASSES and data.num_classes == 10 and data.has_train
    assert data.input_shape == (3, 32, 32) and data.mean == imagefolder.IMAGENET_MEAN
    _, files = imagefolder.scan(root, "val")
    files = [f for f in files if not f[0].endswith("broken.jpg")]
    assert len(data.test_x) == len(files) == 30
    evaluation = T.Compose([T.Resize(40), T.CenterCrop(32), T.PILToTensor()])
    stored = T.Compose([T.Resize(40), T.CenterCrop(40), T.PILToTensor()])
    kinds = set()
    for i, (rel, label, _, _) in enumerate(files):
        with Image.open(root / rel) as img:
            kinds.add(img.mode)
            rgb = img.convert("RGB")
        assert torch.equal(data.test_x[i], evaluation(rgb).float() / 255), rel  # exact: same uint8 codes
        assert int(data.test_y[i]) == label == CLASSES.index(Path(rel).parent.name)
    assert {"L", "CMYK", "P", "RGB"} <= kinds
    _, train_files = imagefolder.scan(root, "train")
    for i in (0, 3, 6, 9):  # RGB, grayscale, CMYK, palette
        with Image.open(root / train_files[i][0]) as img:
            rgb = img.convert("RGB")
        assert torch.equal(data.train_x.raw([i])[0], stored(rgb))
        assert torch.equal(data.train_x[i], evaluation(rgb).float() / 255)  # its centre crop is the val transform


def test_second_load_decodes_nothing_and_says_so(tree, tmp_path, decodes, capsys):
    root, _ = tree
    cfg = cfg_of(root, tmp_path, skip_bad=True)
    first = load_dataset(cfg)
    assert len(decodes) == 61 and "decoded 31 val images" in capsys.readouterr().out
    decodes.clear()
    again = load_dataset(cfg)
    out = capsys.readouterr().out
    assert decodes == [] and out.count("decoded nothing") == 2 and "using cache" in out
    assert torch.equal(again.test_x.to(), first.test_x.to()) and torch.equal(again.train_y, first.train_y)


def test_digest_follows_the_file_list(tmp_path, decodes):
    from PIL import Image

    root = tmp_path / "data"
    write_imagefolder(root, per_class=1, splits=("val",), corrupt=False)
    cfg = cfg_of(root, tmp_path / "cache")
    before = imagefolder.digest(cfg)
    load_dataset(cfg)
    decodes.clear()
    target = root / "val" / CLASSES[5] / "img_0.JPEG"
    Image.new("RGB", (50, 41), (200, 10, 10)).save(target)  # another image under the same name
    imagefolder._digest.cache_clear()  # as a new command would start
    assert imagefolder.digest(cfg) != before
    data = load_dataset(cfg)
    assert len(decodes) == 10 and data.test_x[5][0].mean() > 0.7  # rebuilt: the new red image
    assert len([p for p in (tmp_path / "cache").glob("val-*") if p.is_dir()]) == 2
    assert imagefolder.digest(cfg_of(root, tmp_path / "cache", crop=30)) != imagefolder.digest(cfg)


def test_damaged_image_is_named_or_skipped(tree, tmp_path):
    root, bad = tree
    with pytest.raises(UserError, match=str(bad).replace(".", r"\.")) as exc:
        load_dataset(cfg_of(root, tmp_path))
    assert "data.skip_bad=true" in str(exc.value)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # nothing cached
    data = load_dataset(cfg_of(root, tmp_path, skip_bad=True))
    rel = str(bad.relative_to(root))
    assert data.info["val"]["bad"] == [rel] and len(data.test_x) == 30 and len(data.test_y) == 30
    meta = json.loads((Path(data.info["val"]["cache"]) / "meta.json").read_text())
    assert [b["path"] for b in meta["bad"]] == [rel] and meta["bad"][0]["error"]
    with pytest.raises(UserError, match="damaged"):  # the cache built with skip_bad does not hide it later
        load_dataset(cfg_of(root, tmp_path))


def test_damaged_image_exits_2_through_the_cli(tree, tmp_path, capsys):
    from runner.cli import main

    root, bad = tree
    with pytest.raises(SystemExit) as exit_:  # Hydra's task ends with sys.exit(2) on a user error
        main(["train", "data=imagefolder", f"data.root={root}", f"data.cache_dir={tmp_path / 'cache'}",
              "data.workers=1", "data.resize=40", "data.crop=32", f"paths.results={tmp_path / 'results'}",
              f"paths.checkpoints={tmp_path / 'ckpt'}"])
    rc = exit_.value.code
    captured = capsys.readouterr()
    assert rc == 2 and str(bad) in captured.out + captured.err
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("*.pt"))


def test_limit_is_stratified_seeded_and_decodes_only_those(tree, tmp_path, decodes):
    labels = [c for c in range(10) for _ in range(7)]
    a = imagefolder.stratified_subset(labels, 25, seed=0)
    assert np.array_equal(a, imagefolder.stratified_subset(labels, 25, seed=0)) and len(set(a)) == 25
    assert sorted(np.bincount(np.asarray(labels)[a], minlength=10)) == [2] * 5 + [3] * 5
    assert not np.array_equal(a, imagefolder.stratified_subset(labels, 25, seed=1))
    root, _ = tree
    data = load_dataset(cfg_of(root, tmp_path, limit=10, limit_seed=3, skip_bad=True))
    assert len(decodes) == 20  # 10 of each split, nothing else decoded
    assert len(data.train_y) == 10 and sorted(data.train_y.tolist()) == list(range(10))


def test_a_build_that_dies_leaves_nothing_trusted(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_imagefolder(root, per_class=1, splits=("val",), corrupt=False)
    cache = tmp_path / "cache"
    cfg = cfg_of(root, cache)
    real, calls = imagefolder.decode, []

    def dies(path, *a):
        calls.append(path)
        if len(calls) == 6:
            raise KeyboardInterrupt  # Ctrl-C (or a crash) in the middle of the build
        return real(path, *a)
    monkeypatch.setattr(imagefolder, "decode", dies)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C: the build cleans up after itself
        load_dataset(cfg)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []
    calls.clear()
    from runner.data import cache as cache_module

    with monkeypatch.context() as killed:  # SIGKILL: no clean-up runs at all
        killed.setattr(cache_module.shutil, "rmtree", lambda *a, **k: None)
        with pytest.raises(KeyboardInterrupt):
            load_dataset(cfg)
    assert [p.name for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".tmp-")] == []
    monkeypatch.setattr(imagefolder, "decode", real)
    good = load_dataset(cfg)
    assert not list(cache.glob(".tmp-*"))  # the dead build's leftovers, removed under the lock
    # a cache directory without its meta.json (written last) is never read
    digest_dir = Path(good.info["val"]["cache"])
    (digest_dir / "meta.json").unlink()
    (cache / f".tmp-{digest_dir.name}-99999").mkdir()
    calls.clear()
    monkeypatch.setattr(imagefolder, "decode", lambda p, *a: (calls.append(p), real(p, *a))[1])
    again = load_dataset(cfg)
    assert len(calls) == 10 and torch.equal(again.test_x.to(), good.test_x.to())
    assert not list(cache.glob(".tmp-*"))


def test_only_val_and_split_names(tmp_path):
    root = tmp_path / "data"
    write_imagefolder(root, per_class=2, splits=("validation",), corrupt=False)
    with pytest.raises(UserError, match="data.val_split"):
        load_dataset(cfg_of(root, tmp_path / "cache"))
    data = load_dataset(cfg_of(root, tmp_path / "cache", val_split="validation"))
    assert not data.has_train and len(data.train_x) == 0 and data.train_x.shape[1:] == (3, 32, 32)
    assert len(data.test_x) == 20
    held = data.carve("test", 0.5, seed=0)  # what the model side calibrates on when there is no train/
    assert len(held.test_y) == 10 and torch.bincount(held.test_y).tolist() == [1] * 10
    assert isinstance(held.train_x, Images) and isinstance(held.test_x, Images)
    together = torch.cat([held.train_x.to(), held.test_x.to()])
    assert len({t.numpy().tobytes() for t in together}) == 20  # disjoint, all there


def test_lazy_images_behave_as_the_tensor():
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (10, 3, 12, 12), dtype=torch.uint8, generator=gen)
    x = Images(raw.numpy(), crop=8)
    full = raw[:, :, 2:10, 2:10].float() / 255
    assert x.shape == (10, 3, 8, 8) and len(x) == 10
    assert torch.equal(x.to(), full) and torch.equal(x[3], full[3])
    assert isinstance(x[2:7], Images) and torch.equal(x[2:7].to(), full[2:7])
    assert torch.equal(x[2:7][1:3].to(), full[3:5])
    idx = torch.tensor([7, 1, 4])
    assert torch.equal(x[idx], full[idx]) and torch.equal(x.take(idx)[1:].to(), full[idx[1:]])
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[2, 9]] = True
    assert torch.equal(x[mask], full[mask])


def test_the_pixel_table_is_the_hosts_division():
    from runner.data.dataset import _PIXELS

    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(_PIXELS[every.int()], every.float().div_(255.0))


@pytest.mark.cuda
def test_lazy_images_divided_on_the_gpu_are_the_hosts_bits():
    raw = torch.arange(256, dtype=torch.uint8).repeat(3 * 20 * 20 // 256 + 1)[:3 * 20 * 20].reshape(1, 3, 20, 20)
    x = Images(raw.repeat(4, 1, 1, 1).numpy(), crop=16)
    assert torch.equal(x.to("cuda").cpu(), x.to()) and x.to("cuda").dtype == torch.float32
    assert torch.equal(x[1:3].to("cuda", torch.float64).cpu(), x[1:3].to().double())


def test_training_batches_augmented_seeded_evaluation_untouched(tree, tmp_path):
    root, _ = tree
    data = load_dataset(cfg_of(root, tmp_path, skip_bad=True))
    xb, yb = next(iter(data.loader("train", 30)))
    assert torch.equal(xb, data.train_x.to()) and torch.equal(yb, data.train_y)  # unshuffled: untouched
    a, ya = next(iter(data.loader("train", 8, shuffle=True, seed=0)))
    b, yb = next(iter(data.loader("train", 8, shuffle=True, seed=0)))
    assert a.shape == (8, 3, 32, 32) and a.dtype == torch.float32 and torch.equal(a, b) and torch.equal(ya, yb)
    c, _ = next(iter(data.loader("train", 8, shuffle=True, seed=1)))
    assert not torch.equal(a, c)
    crop = RandomResizedCropFlip(32, seed=0)
    assert all(0 < h <= 40 and 0 < w <= 40 and t + h <= 40 and l + w <= 40
               for t, l, h, w in (crop.params(40, 40) for _ in range(50)))


def test_run_timed_streams_a_lazy_set():
    from runner.evaluate import run_timed

    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (20, 3, 8, 8), dtype=torch.uint8, generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 5))
    lazy = run_timed(model, Images(raw.numpy()), 6, torch.device("cpu"), warmup=1, repeats=1)
    eager = run_timed(model, raw.float() / 255, 6, torch.device("cpu"), warmup=1, repeats=1)
    assert torch.equal(lazy.logits, eager.logits) and len(lazy.batch_ms) == 4


def test_config_composes_and_the_cache_place_is_not_the_data(tree, tmp_path):
    from runner.train import weight_config
    from tests.conftest import compose

    root, _ = tree
    cfg = compose("compare", ["data=imagefolder", f"data.root={root}", "data.skip_bad=true", *(
        f"data.{k}={v}" for k, v in SMALL.items())], tmp_path)
    assert cfg.data.cache_dir == f"{tmp_path / 'checkpoints'}/data-cache" and cfg.data.image_size == 32
    moved = compose("compare", ["data=imagefolder", f"data.root={root}", "data.skip_bad=true", "data.workers=2",
                                f"data.cache_dir={tmp_path / 'elsewhere'}",
                                *(f"data.{k}={v}" for k, v in SMALL.items())], tmp_path)
    assert weight_config(cfg) == weight_config(moved)  # where the cache lies does not name another baseline
    limited = compose("compare", ["data=imagefolder", f"data.root={root}", "data.limit=10", *(
        f"data.{k}={v}" for k, v in SMALL.items())], tmp_path)
    assert weight_config(limited)["data"]["sha256"] != weight_config(cfg)["data"]["sha256"]


def test_a_torchvision_model_fits_a_lazily_read_set(tmp_path):
    """The check before a sweep, sensitivity or search runs the model on two training images, which a set of
    val/ only reads lazily (its held-apart calibration part)."""
    from runner.data import load_dataset
    from runner.train import check_model_fits, held_apart

    root = tmp_path / "val-only"
    write_imagefolder(root, per_class=2, splits=("val",), corrupt=False)
    cfg = OmegaConf.create({"data": cfg_of(root, tmp_path / "cache", calib_images=10),
                            "model": {"name": "torchvision", "arch": "resnet18", "weights": None, "num_classes": 10,
                                      "_target_": "runner.models.torchvision_models.build"}})
    data = held_apart(load_dataset(cfg.data), cfg)
    assert isinstance(data.train_x, Images)
    check_model_fits(cfg, data)  # no error: it fits
    cfg.model.num_classes = 7
    with pytest.raises(UserError, match="7 outputs|outputs of shape"):
        check_model_fits(cfg, data)


def test_train_limit_and_excluded_images(tree, tmp_path, decodes):
    """data.train_limit limits train/ alone; data.exclude_images leaves the files it lists out of the images
    measured, by name, from the same cache; both are other data (digest)."""
    from runner.train import left_out

    root, _ = tree
    cfg = cfg_of(root, tmp_path, skip_bad=True, train_limit=10)
    data = load_dataset(cfg)
    assert len(data.train_y) == 10 and len(data.test_y) == 30 and len(decodes) == 41
    names = data.test_x.names()
    assert len(names) == 30 and names[0].startswith("val/") and names == sorted(names)
    assert data.test_x.take([1, 0]).names() == names[:2][::-1] and data.test_x[3:5].names() == names[3:5]
    assert data.train_x.names() is None  # train/ keeps no names: nothing measures its images
    listed = tmp_path / "exclude.txt"
    listed.write_text(f"{names[4]}\n{names[17]}\nval/not/there.jpg\n")
    excluded = cfg_of(root, tmp_path, skip_bad=True, train_limit=10, exclude_images=str(listed))
    decodes.clear()
    fewer = left_out(load_dataset(excluded), OmegaConf.create({"data": excluded}))
    assert decodes == [] and len(fewer.test_y) == 28 and fewer.test_x.names() == names[:4] + names[5:17] + names[18:]
    assert torch.equal(fewer.test_x[4], data.test_x[5]) and int(fewer.test_y[4]) == int(data.test_y[5])
    assert len({imagefolder.digest(c) for c in (cfg, excluded, cfg_of(root, tmp_path, skip_bad=True))}) == 3
    with pytest.raises(UserError, match="data.exclude_images"):
        left_out(data, OmegaConf.create({"data": cfg_of(root, tmp_path, exclude_images=str(tmp_path / "no.txt"))}))


def test_loaded_reads_ahead_in_order(tmp_path):
    """The evaluation loops' reader: on a GPU (any device but the CPU) a lazily read set's next batch is read in
    a thread while the current one computes; the batches come out in order with the same values as Images.to,
    and a read that fails raises in the loop. On the CPU, and for tensors, each batch is simply moved."""
    from runner.data.dataset import Images, loaded

    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (10, 3, 6, 6), dtype=np.uint8)
    x = Images(array, None, 4)
    batches = [x[i:i + 3] for i in range(0, 10, 3)]
    want = [b.to() for b in batches]
    got = list(loaded(batches, torch.device("meta")))  # not the CPU: the read-ahead path; meta keeps it device-free
    assert [g.shape for g in got] == [w.shape for w in want] and all(g.device.type == "meta" for g in got)
    order = []

    class Recorded(Images):
        def host_pixels(self):
            order.append(int(self._rows()[0]))
            return super().host_pixels()

    rec = [Recorded(array, np.arange(i, min(i + 3, 10)), 4) for i in range(0, 10, 3)]
    assert [int(b.shape[0]) for b in loaded(rec, torch.device("meta"))] == [3, 3, 3, 1]
    assert order == [0, 3, 6, 9]
    assert all(torch.equal(g, w) for g, w in zip(loaded(batches, torch.device("cpu")), want))

    class Echo(Images):  # what the read-ahead hands to each batch's `to`: that batch's own pixels
        def to(self, device=None, dtype=None, pixels=None, **kwargs):
            return pixels

    echo = [Echo(array, np.arange(i, min(i + 3, 10)), 4) for i in range(0, 10, 3)]
    assert all(torch.equal(g, b.host_pixels()) for g, b in zip(loaded(echo, torch.device("meta")), echo))

    class Broken(Images):
        def host_pixels(self):
            raise OSError("read failed")

    with pytest.raises(OSError, match="read failed"):
        list(loaded([Broken(array, None, 4)], torch.device("meta")))
