"""compare's plan (plan_run): what identifies a row, and config errors caught before any work."""
import pytest

from runner.compare import plan_run
from runner.errors import UserError
from tests.conftest import compose


def test_row_keys_follow_what_determines_the_numbers(tmp_path):
    a = plan_run(compose("compare", ["multiplier=mul8s_1L2J", "backend=python"], tmp_path)).row_keys
    b = plan_run(compose("compare", ["multiplier=mul8s_1KV6", "backend=python"], tmp_path)).row_keys
    u = plan_run(compose("compare", ["multiplier=mul8u_17C8", "backend=python"], tmp_path)).row_keys
    q = plan_run(compose("compare", ["multiplier=mul8s_1L2J", "backend=python",
                                     "quant=per_tensor_minmax"], tmp_path)).row_keys
    assert a["pytorch"] == b["pytorch"] == u["pytorch"] == q["pytorch"]  # fp32 row shared by all
    assert a["fakequant"] == b["fakequant"] != u["fakequant"]            # depends on signedness only
    assert q["fakequant"] != a["fakequant"]                              # and on the quant scheme
    assert len({a["approx"], b["approx"], u["approx"], q["approx"]}) == 4


def test_unknown_layer_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="conv9"):
        plan_run(compose("compare", ["backend=python", "model.approx_layers=[conv9]"], tmp_path))


def test_selected_layers(tmp_path):
    planned = plan_run(compose("compare", ["backend=python", "model.approx_layers=[conv2,fc1]"], tmp_path))
    layers, mults = planned.approx_layers, planned.multipliers
    assert layers == ["conv2", "fc1"] and set(mults) == {"conv1", "conv2", "fc1", "fc2", "fc3"}


def test_one_name_per_table():
    """The exact signed product is one table whatever it is called: one name and one power figure in rows."""
    from runner.compare import multiplier_columns
    from runner.multipliers import resolve_per_layer

    layers = ["conv1", "fc3"]
    cols = [multiplier_columns(resolve_per_layer({"name": n}, layers), layers)
            for n in ("exact", "exact_s", "exact_signed", "mul8s_1KV6")]
    assert {c["multiplier"] for c in cols} == {"exact_s"}
    assert {c["multiplier_per_layer"] for c in cols} == {"conv1=exact_s;fc3=exact_s"}
    assert {c["published_power_mw"] for c in cols} == {0.425}
    unsigned = multiplier_columns(resolve_per_layer({"name": "exact_unsigned"}, layers), layers)
    assert unsigned["multiplier"] == "exact_u"
    other = multiplier_columns(resolve_per_layer({"name": "mul8s_1L2J"}, layers), layers)
    assert other["multiplier"] == "mul8s_1L2J"


def test_scope_says_what_was_approximated():
    from runner.compare import scope_of
    from runner.multipliers import resolve_per_layer

    names = ["conv1", "conv2", "fc1"]
    uniform = resolve_per_layer({"name": "mul8u_T83"}, names)
    mixed = resolve_per_layer({"name": "mul8u_T83", "layers": {"conv1": "mul8s_1L2J"}}, names)
    assert scope_of("approx", uniform, names) == "network"
    assert scope_of("approx", uniform, ["fc1"]) == "layer"
    assert scope_of("approx", mixed, names) == "assignment"
    assert scope_of("approx_finetuned", uniform, names) == "finetuned"
    assert {scope_of(p, uniform, names) for p in ("pytorch", "fakequant")} == {"reference"}


def test_row_numbers_at_their_real_precision():
    """Accuracy and agreement are fractions of counts (no float32 mean: 0.7990000247955322 was written)."""
    from types import SimpleNamespace

    import torch

    from runner.compare import _row

    y = torch.zeros(1000, dtype=torch.long)
    preds = y.clone()
    preds[:201] = 1                                           # 799 of 1000 right
    timed = SimpleNamespace(predictions=preds, latency_ms_median=1.23456789, total_ms_median=12.3456789,
                            pass_ms=[12.3456789], timed_as="eager")
    row = _row("approx", timed, y, {"fakequant": y, "pytorch": preds}, 1000, "cpu", 2)
    assert (row["accuracy"], row["agreement_fakequant"], row["agreement_pytorch"]) == (0.799, 0.799, 1.0)
    assert repr(row["agreement_fakequant"]) == "0.799"
    assert (row["latency_ms_median"], row["testset_ms_median"], row["throughput_img_s"]) == (1.235, 12.346, 81000.0)


def test_two_data_roots_under_one_name_train_and_record_twice(tmp_path, capsys):
    """data=mnist from two different IDX directories: two checkpoints, two rows, and the reason is said."""
    import pandas as pd

    from runner import session
    from runner.cli import main
    from tests.data.test_mnist import _write_set

    for name, seed in (("A", 0), ("B", 1)):
        (tmp_path / name).mkdir()
        _write_set(tmp_path / name, n_train=40, n_test=20, seed=seed)

    def compare(root):
        args = ["compare", "data=mnist", f"data.root={root}", "backend=python", "train.epochs=1", "eval.repeats=1",
                "eval.warmup=0", "eval.batch_size=20", "quant.calib_batches=1", f"paths.results={tmp_path / 'r'}",
                f"paths.checkpoints={tmp_path / 'ck'}"]
        session.reset()
        assert main(args) == 0
        return capsys.readouterr().out

    first = compare(tmp_path / "A")
    assert "no checkpoint for this data and recipe (data digest" in first
    second = compare(tmp_path / "B")
    assert "no checkpoint for this data and recipe" in second and "of other data" in second
    assert len(list((tmp_path / "ck").glob("lenet5_mnist-*.pt"))) == 2
    rows = pd.read_csv(tmp_path / "r" / "results.csv")
    approx = rows[rows["path"] == "approx"]
    assert len(approx) == 2 and approx["row_key"].nunique() == 2 and approx["data_sha256"].nunique() == 2
    assert set(approx["scope"]) == {"network"} and set(rows.loc[rows["path"] != "approx", "scope"]) == {"reference"}
    assert "reusing checkpoint" in compare(tmp_path / "A")      # the same files again: A's checkpoint
    session.reset()


def _leaves(node, prefix=""):
    from omegaconf import DictConfig

    for k, v in node.items():
        if isinstance(v, DictConfig):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _changed(value):
    """Another valid value of a numeric or boolean setting, or None."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.99 if value else 0.25
    return None


# Settings that do not change a row's numbers (timing passes, where files lie, what to record, forcing a
# retrain that gives the same weights) or that this configuration does not use (the zoo's recipe, the
# retraining recipe of a data set when finetune is off, the shape keys the model takes from the data).
NOT_IN_KEY = {"eval.warmup", "eval.repeats", "eval.cuda_graph", "train.force", "train.eval_batch_size", "data.zoo_train_epochs",
              "data.vit_train_epochs", "data.vit_train_shift",
              "data.finetune_batch_size", "data.finetune_epochs", "data.finetune_warmup_epochs", "data.in_channels",
              "data.image_size", "data.num_classes", "finetune.force", "finetune.cuda_graph",
              # where a result is computed, recorded in its columns (eval_world_size, finetune_devices): a sharded
              # evaluation equals the one-device row, a resumed retraining the uninterrupted one (both tested in
              # test_distributed), and DDP at the same global batch differs only in the order of float sums
              "eval.devices", "train.devices", "finetune.devices", "finetune.resume"}


def test_every_setting_that_changes_the_numbers_is_in_the_row_key(tmp_path):
    """Walks every numeric/boolean setting of eval, train, quant, data, finetune and seed (and eval.limit,
    null by default): changing one must change the key of the rows it changes, or two results of different
    settings would collide (resume would skip the second)."""
    from omegaconf import OmegaConf

    base_over = ["backend=python", "finetune.epochs=1"]
    cfg = compose("compare", base_over, tmp_path)
    base = plan_run(cfg).row_keys
    settings = [(k, _changed(v)) for g in ("eval", "train", "quant", "data", "finetune")
                for k, v in _leaves(cfg[g], f"{g}.") if k not in NOT_IN_KEY and _changed(v) is not None]
    settings += [("seed", 1), ("eval.limit", 100), ("backend.algo", "direct"), ("model.approx_layers", ["conv1"])]
    assert {"eval.batch_size", "train.lr", "quant.percentile", "finetune.lr", "finetune.epochs"} <= {k for k, _ in settings}
    missed = []
    for key, value in settings:
        changed_cfg = cfg.copy()
        OmegaConf.update(changed_cfg, key, value, merge=False)   # no Hydra compose per setting: fast
        keys = plan_run(changed_cfg).row_keys
        changed = "approx_finetuned" if key.startswith("finetune.") else "approx"
        if keys[changed] == base[changed]:
            missed.append(key)
    assert missed == [], f"settings missing from the row key: {missed}"
    some = cfg.copy()
    OmegaConf.update(some, "model.approx_layers", ["conv1"], merge=False)
    other = some.copy()
    OmegaConf.update(other, "model.other_layers", "fakequant", merge=False)  # matters once some layers are not approx
    assert plan_run(some).row_keys["approx"] != plan_run(other).row_keys["approx"]
