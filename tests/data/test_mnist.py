import gzip
import os
import struct

import numpy as np
import pytest
import torch

from runner.data import load_dataset, load_idx_dataset, load_mnist5k, read_idx
from runner.errors import UserError


def test_mnist5k_split_shapes_dtypes_balance(mnist5k):
    assert mnist5k.train_x.shape == (4000, 1, 28, 28) and mnist5k.test_x.shape == (1000, 1, 28, 28)
    assert mnist5k.train_x.dtype == torch.float32 and mnist5k.train_y.dtype == torch.int64
    assert 0.0 <= mnist5k.train_x.min() and mnist5k.train_x.max() <= 1.0
    assert torch.bincount(mnist5k.train_y, minlength=10).tolist() == [400] * 10
    assert torch.bincount(mnist5k.test_y, minlength=10).tolist() == [100] * 10
    # real digits, not noise: a mean digit has ink in the centre and none in the corner
    mean_img = mnist5k.train_x.mean(0)[0]
    assert mean_img[10:18, 10:18].mean() > 0.2 and mean_img[:3, :3].max() == 0


def test_mnist5k_split_deterministic_and_disjoint(mnist5k):
    again = load_mnist5k(seed=0)
    assert torch.equal(again.test_x, mnist5k.test_x) and torch.equal(again.train_y, mnist5k.train_y)
    other = load_mnist5k(seed=1)
    assert not torch.equal(other.test_x, mnist5k.test_x)
    train = {t.numpy().tobytes() for t in mnist5k.train_x}
    assert sum(t.numpy().tobytes() in train for t in mnist5k.test_x[:200]) <= 2  # MNIST has few duplicates


def _write_idx(path, array, gz=False):
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


def _write_set(root, n_train=20, n_test=10, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    sfx = ".gz" if gz else ""
    _write_idx(root / f"train-images-idx3-ubyte{sfx}", rng.integers(0, 256, (n_train, 28, 28)), gz)
    _write_idx(root / f"train-labels-idx1-ubyte{sfx}", rng.integers(0, 10, n_train), gz)
    _write_idx(root / f"t10k-images-idx3-ubyte{sfx}", rng.integers(0, 256, (n_test, 28, 28)), gz)
    _write_idx(root / f"t10k-labels-idx1-ubyte{sfx}", rng.integers(0, 10, n_test), gz)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip(tmp_path, gz):
    _write_set(tmp_path, gz=gz)
    ds = load_idx_dataset("mnist", tmp_path)
    assert ds.train_x.shape == (20, 1, 28, 28) and ds.test_x.shape == (10, 1, 28, 28)
    raw = read_idx(tmp_path / f"train-images-idx3-ubyte{'.gz' if gz else ''}")
    assert torch.equal(ds.train_x[:, 0], torch.from_numpy(raw.astype(np.float32) / 255))


def test_dotted_idx_names_accepted(tmp_path):
    """Some mirrors name the files train-images.idx3-ubyte; the loader takes both spellings."""
    _write_set(tmp_path)
    for f in tmp_path.iterdir():
        f.rename(tmp_path / f.name.replace("-idx", ".idx"))
    assert load_idx_dataset("mnist", tmp_path).train_x.shape == (20, 1, 28, 28)


def test_missing_dataset_names_path_and_fix(tmp_path):
    with pytest.raises(UserError) as e:
        load_idx_dataset("fashion_mnist", tmp_path / "nowhere")
    msg = str(e.value)
    assert str(tmp_path / "nowhere") in msg and "dataset-fashion-mnist" in msg


@pytest.mark.parametrize("corrupt", ["magic", "truncated", "labels"])
def test_malformed_idx(tmp_path, corrupt):
    _write_set(tmp_path)
    target = tmp_path / "t10k-images-idx3-ubyte"
    if corrupt == "magic":
        target.write_bytes(b"\x12\x34" + target.read_bytes()[2:])
    elif corrupt == "truncated":
        target.write_bytes(target.read_bytes()[:-7])
    else:
        _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.full(10, 12))
    with pytest.raises(UserError) as e:
        load_idx_dataset("mnist", tmp_path)
    assert "t10k" in str(e.value)


def test_unknown_dataset_name():
    from omegaconf import OmegaConf

    with pytest.raises(UserError, match="Unknown data set"):
        load_dataset(OmegaConf.create({"name": "cifar"}))


def test_validation_split_is_stratified_seeded_and_disjoint(mnist5k):
    val = mnist5k.validation_split(0.25, seed=1)
    assert len(val.test_x) == 1000 and len(val.train_x) == 3000
    assert torch.bincount(val.test_y).tolist() == [100] * 10
    assert torch.equal(val.test_x, mnist5k.validation_split(0.25, seed=1).test_x)
    assert not torch.equal(val.test_x, mnist5k.validation_split(0.25, seed=2).test_x)
    flat = {tuple(r.tolist()) for r in val.train_x.flatten(1)[:, 200:260]}
    assert not any(tuple(r.tolist()) in flat for r in val.test_x.flatten(1)[:, 200:260] if r.any())


def test_data_digest_is_the_content_not_the_place(tmp_path):
    from omegaconf import OmegaConf

    from runner.data import data_digest

    def cfg(root):
        return OmegaConf.create({"name": "mnist", "root": str(root), "download": False})

    for name, seed in (("a", 0), ("same_as_a", 0), ("b", 1)):
        (tmp_path / name).mkdir()
        _write_set(tmp_path / name, seed=seed)
    a = data_digest(cfg(tmp_path / "a"))
    assert len(a) == 64 and a == data_digest(cfg(tmp_path / "same_as_a"))
    assert data_digest(cfg(tmp_path / "b")) != a
    labels = tmp_path / "a" / "t10k-labels-idx1-ubyte"
    raw = bytearray(labels.read_bytes())
    raw[-1] = (raw[-1] + 1) % 10                              # one test label changed, same size
    labels.write_bytes(bytes(raw))
    os.utime(labels, ns=(labels.stat().st_atime_ns, labels.stat().st_mtime_ns + 10**9))
    assert data_digest(cfg(tmp_path / "a")) != a
    with pytest.raises(UserError, match="not found"):
        data_digest(cfg(tmp_path / "nowhere"))
    assert len(data_digest(OmegaConf.create({"name": "mnist5k", "split_seed": 0}))) == 64


def test_pixels_are_the_float32_quotient_of_every_byte():
    """pixels writes pixel / 255 into its array in one step: the same float32 bits as the float32 copy divided
    by 255.0, for each of the 256 byte values, in the [N, 1, H, W] layout."""
    from runner.data.mnist import pixels

    images = np.arange(256, dtype=np.uint8).reshape(1, 16, 16).repeat(3, axis=0)
    got = pixels(images)
    want = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    assert got.dtype == torch.float32 and got.shape == (3, 1, 16, 16) and got.is_contiguous()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_idx_files_decoded_once_per_process_and_change(tmp_path, monkeypatch):
    """A second load reads no file again; a rewritten file is read again; files decoded by another process
    (adopt_decoded) are used while their files are unchanged, never once they changed."""
    from runner.data import mnist

    monkeypatch.setattr(mnist, "_DECODED", {})
    _write_set(tmp_path)
    first = load_idx_dataset("mnist", tmp_path)
    reads = []
    monkeypatch.setattr(mnist, "read_idx", lambda p: reads.append(p) or read_idx(p))
    again = load_idx_dataset("mnist", tmp_path)
    assert reads == [] and torch.equal(again.train_x, first.train_x) and torch.equal(again.test_y, first.test_y)

    handed = mnist.decoded_files()
    monkeypatch.setattr(mnist, "_DECODED", {})  # another process: nothing decoded yet
    mnist.adopt_decoded(handed)
    assert torch.equal(load_idx_dataset("mnist", tmp_path).train_x, first.train_x) and reads == []

    _write_set(tmp_path, seed=1)  # other pixels, the same sizes: the mtime tells
    path = tmp_path / "train-images-idx3-ubyte"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    changed = load_idx_dataset("mnist", tmp_path)
    assert path in reads and not torch.equal(changed.train_x, first.train_x)
    assert torch.equal(changed.train_x[:, 0], torch.from_numpy(read_idx(path).astype(np.float32) / 255))
