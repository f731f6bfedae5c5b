import torch

from runner.models import LeNet5, fold_input_normalization
from runner.train import checkpoint_path, load_checkpoint, load_or_train, save_checkpoint
from tests.conftest import compose


def test_lenet5_shapes():
    model = LeNet5(mean=0.1307, std=0.3081)
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)
    assert [m.in_features for m in (model.fc1, model.fc2, model.fc3)] == [256, 120, 84]


def test_short_training_beats_chance(trained_lenet):
    _, history = trained_lenet
    assert history[-1]["test_accuracy"] > 0.85          # chance is 0.10
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert set(history[0]) == {"epoch", "train_loss", "test_accuracy", "seconds"}


def test_fold_normalization_is_exact(trained_lenet, mnist5k):
    model, _ = trained_lenet
    x = mnist5k.test_x[:64]
    folded = fold_input_normalization(model)
    torch.testing.assert_close(folded(x), model(x), rtol=1e-4, atol=1e-4)
    assert isinstance(folded.normalize, torch.nn.Identity)


def test_checkpoint_round_trip_weights_only(tmp_path, trained_lenet, mnist5k):
    model, _ = trained_lenet
    cfg = compose("train", [], tmp_path)
    path = checkpoint_path(cfg)
    save_checkpoint(path, model, {"test_accuracy": 0.5, "data": "mnist5k"})
    blob = torch.load(path, weights_only=True)
    assert set(blob) == {"state_dict", "meta"} and blob["meta"]["test_accuracy"] == 0.5
    loaded, meta = load_checkpoint(path, cfg, mnist5k)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    assert not list(path.parent.glob(".*.tmp"))  # atomic write left no temp file


def test_checkpoint_name_depends_only_on_weight_config(tmp_path):
    base = checkpoint_path(compose("train", [], tmp_path))
    assert checkpoint_path(compose("train", ["train.force=true", "device=cpu"], tmp_path)) == base
    # the retraining batch lives in the data config but does not touch the baseline's weights
    assert checkpoint_path(compose("train", ["data.finetune_batch_size=64"], tmp_path)) == base
    assert checkpoint_path(compose("train", ["data.finetune_epochs=7", "data.finetune_warmup_epochs=1"], tmp_path)) == base
    assert checkpoint_path(compose("train", ["train.epochs=3"], tmp_path)) != base
    assert checkpoint_path(compose("train", ["seed=1"], tmp_path)) != base
    assert checkpoint_path(compose("compare", [], tmp_path)) == base  # compare finds train's checkpoint


def test_load_or_train_reuses(tmp_path, mnist5k):
    cfg = compose("train", ["train.epochs=1"], tmp_path)
    _, meta1, path, _ = load_or_train(cfg, mnist5k)
    mtime = path.stat().st_mtime_ns
    _, meta2, path2, _ = load_or_train(cfg, mnist5k)
    assert path2 == path and path.stat().st_mtime_ns == mtime and meta1 == meta2


def test_bad_training_settings_are_user_errors(tmp_path, mnist5k):
    import pytest

    from runner.errors import UserError
    from runner.train import train_model

    for bad in ("train.epochs=0", "train.batch_size=0", "train.lr=0", "train.epochs=3O", "train.weight_decay=-1"):
        with pytest.raises(UserError, match=bad.split("=")[0].replace(".", r"\.") + "="):
            train_model(compose("train", [bad], tmp_path), mnist5k, torch.device("cpu"))
    with pytest.raises(UserError, match="train.schedule"):
        train_model(compose("train", ["train.schedule=linear"], tmp_path), mnist5k, torch.device("cpu"))


def test_shift_moves_training_batches_only(mnist5k):
    import dataclasses

    import pytest

    from runner.data import CropFlip
    from runner.errors import UserError
    from runner.train import train_model

    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).reshape(2, 1, 6, 6)
    out, _ = CropFlip(seed=3, pad=2, flip=False)([(x[i], torch.tensor(i)) for i in range(2)])
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):  # a window of the padded image, never mirrored
        assert any(torch.equal(out[i], padded[i, :, dy:dy + 6, dx:dx + 6]) for dy in range(5) for dx in range(5))
    small = dataclasses.replace(mnist5k, train_x=mnist5k.train_x[:256], train_y=mnist5k.train_y[:256])
    (xs, ys), (xp, yp) = (next(iter(small.loader("train", 256, shuffle=True, seed=0, shift=s))) for s in (2, 0))
    assert torch.equal(ys, yp) and not torch.equal(xs, xp) and xs.sum() <= xp.sum()  # moved, pixels may leave
    assert (xs != xp).flatten(1).any(1).float().mean() > 0.5  # most images moved (1 in 25 stays put)
    xe, _ = next(iter(small.loader("train", 256, shuffle=False, shift=2)))  # calibration, evaluation: as they are
    assert torch.equal(xe, small.train_x)
    cfg = compose("train", ["model=vit", "train.shift=2", "train.epochs=1"])
    with pytest.raises(UserError, match="own training augmentation"):
        train_model(cfg, dataclasses.replace(small, augment=True), torch.device("cpu"))
    with pytest.raises(UserError, match=r"train\.shift="):
        train_model(compose("train", ["model=vit", "train.shift=-1"]), small, torch.device("cpu"))
