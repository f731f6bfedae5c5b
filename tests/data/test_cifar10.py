"""CIFAR-10's binary version read from a small generated fixture in the exact file format (nothing is
downloaded or committed): records, normalisation, augmentation for training only, the pickled version
refused, and train / compare / sweep end to end."""
import numpy as np
import pandas as pd
import pytest
import torch

from runner.data import CIFAR10_RECORD, CIFAR10_TEST, CIFAR10_TRAIN, CropFlip, load_cifar10, load_dataset
from runner.errors import UserError
from tests.conftest import compose, has_cpp, run_cli


def write_cifar10(root, per_file: int = 20, seed: int = 0):
    """data_batch_1.bin .. data_batch_5.bin and test_batch.bin: per record 1 label byte + 3,072 pixel bytes
    (R, G, B planes of 32x32). Each class gets a bright square in its own place, so a model can learn it.
    Returns {file name: (labels, pixels uint8 [N, 3, 32, 32])}."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in CIFAR10_TRAIN + CIFAR10_TEST:
        labels = np.arange(per_file) % 10
        rng.shuffle(labels)
        pixels = rng.integers(0, 90, (per_file, 3, 32, 32), dtype=np.uint8)
        for i, c in enumerate(labels):
            r, q = divmod(int(c), 5)
            pixels[i, c % 3, 4 + 14 * r:14 + 14 * r, 2 + 6 * q:7 + 6 * q] = 250
        records = np.concatenate([labels.astype(np.uint8)[:, None], pixels.reshape(per_file, -1)], axis=1)
        (root / name).write_bytes(records.tobytes())
        written[name] = (labels, pixels)
    return written


def test_reads_the_binary_records(tmp_path):
    written = write_cifar10(tmp_path / "cifar-10-batches-bin")
    data = load_cifar10(tmp_path)  # the folder inside root is found too
    assert data.train_x.shape == (100, 3, 32, 32) and data.test_x.shape == (20, 3, 32, 32)
    labels, pixels = written["data_batch_3.bin"]
    torch.testing.assert_close(data.train_x[40:60], torch.from_numpy(pixels).float() / 255)
    assert data.train_y[40:60].tolist() == labels.tolist()
    assert data.test_y.tolist() == written["test_batch.bin"][0].tolist()
    assert len(data.mean) == 3 and data.augment
    val = data.validation_split(0.2, 0)
    assert len(val.test_y) == 20 and len(val.train_y) == 80 and val.augment


def test_pickled_python_version_is_refused_without_unpickling(tmp_path):
    py = tmp_path / "cifar-10-batches-py"
    py.mkdir()
    # a pickle that would run code if loaded: the reader must not touch it
    (py / "data_batch_1").write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    with pytest.raises(UserError, match="binary version") as err:
        load_cifar10(tmp_path)
    assert "python version" in str(err.value) and not (tmp_path / "pwned").exists()
    out = run_cli("compare", "data=cifar10", f"data.root={py}", "model=resnet8",
                  f"paths.results={tmp_path}/r", f"paths.checkpoints={tmp_path}/c")
    assert out.returncode == 2 and "cifar-10-batches-bin" in out.stderr and "Traceback" not in out.stderr


def test_malformed_files_are_user_errors(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * (CIFAR10_RECORD + 5))
    with pytest.raises(UserError, match="whole number"):
        load_cifar10(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"\x0c" + b"\x00" * (CIFAR10_RECORD - 1))
    with pytest.raises(UserError, match="0..9"):
        load_cifar10(tmp_path)
    (tmp_path / "test_batch.bin").unlink()
    with pytest.raises(UserError, match="not found"):
        load_cifar10(tmp_path)


def test_augmentation_only_in_shuffled_training_batches(tmp_path):
    write_cifar10(tmp_path)
    data = load_dataset(compose("train", ["data=cifar10", f"data.root={tmp_path}"]).data)
    xb, _ = next(iter(data.loader("test", 100)))
    assert torch.equal(xb, data.test_x)  # evaluation: untouched
    xb, _ = next(iter(data.loader("train", 100)))
    assert torch.equal(xb, data.train_x)  # unshuffled (calibration): untouched
    xb, yb = next(iter(data.loader("train", 100, shuffle=True, seed=0)))
    assert xb.shape == (100, 3, 32, 32) and not torch.equal(xb, data.train_x[:0].new_zeros(0))
    plain = load_dataset(compose("train", ["data=cifar10", f"data.root={tmp_path}", "data.augment=false"]).data)
    xp, yp = next(iter(plain.loader("train", 100, shuffle=True, seed=0)))
    assert torch.equal(yb, yp) and not torch.equal(xb, xp)


def test_crop_flip_is_a_shifted_mirrored_crop():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).reshape(2, 3, 8, 8)
    out, _ = CropFlip(seed=3, pad=2)([(x[i], torch.tensor(i)) for i in range(2)])
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        windows = [padded[i, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], w) or torch.equal(out[i], w.flip(-1)) for w in windows)


@pytest.mark.slow  # three CLI runs: about a minute alone on 2 cores, minutes on a busy machine
@pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension")
def test_cifar10_train_compare_sweep_end_to_end(tmp_path):
    write_cifar10(tmp_path / "data")
    common = ["data=cifar10", f"data.root={tmp_path / 'data'}", "model=resnet8", "train.epochs=1",
              f"paths.results={tmp_path}/r", f"paths.checkpoints={tmp_path}/c"]
    out = run_cli("train", *common)
    assert out.returncode == 0, out.stderr
    fast = ["eval.repeats=1", "eval.warmup=0", "quant.calib_batches=1", *common]
    out = run_cli("compare", "multiplier=exact", *fast)
    assert out.returncode == 0, out.stderr
    out = run_cli("sweep", "sweep.multipliers=[mul8s_1L2J,mul8s_1KV8]", *fast)
    assert out.returncode == 0, out.stderr
    rows = pd.read_csv(tmp_path / "r" / "results.csv")
    ok = rows[rows.status == "ok"]
    assert set(ok.data) == {"cifar10"} and set(ok.model) == {"resnet8"} and (ok.n_images == 20).all()
    exact = ok[(ok.path == "approx") & (ok.multiplier == "exact")]
    assert (exact.agreement_fakequant == 1.0).all()
    assert {"mul8s_1L2J", "mul8s_1KV8"} <= set(ok.multiplier)
