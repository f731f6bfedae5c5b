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
                            pass_ms=[12.3456789])
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
