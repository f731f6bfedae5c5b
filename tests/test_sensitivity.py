"""`approx-run sensitivity` and `approx-run search`: rows, resume, bad input. Small: 200 test images."""
import pandas as pd
import torch
import pytest

from runner.cli import main
from tests.conftest import compose, has_cpp

pytestmark = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")

FAST = ["eval.limit=200", "train.epochs=1", "quant.calib_batches=1"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from runner.train import load_or_train

    root = tmp_path_factory.mktemp("sens_ckpt")
    load_or_train(compose("sensitivity", [*FAST, f"paths.checkpoints={root}"]))
    return root


def _args(tmp_path, checkpoints, *extra):
    return [*FAST, f"paths.results={tmp_path / 'results'}", f"paths.checkpoints={checkpoints}", *extra]


def test_sensitivity_rows_and_resume(tmp_path, checkpoints, capsys):
    args = ["sensitivity", "sensitivity.multipliers=[mul8s_1KV6,mul8u_T83]", "sensitivity.layers=[conv2,fc3]",
            *_args(tmp_path, checkpoints)]
    assert main(args) == 0
    rows = pd.read_csv(tmp_path / "results" / "results.csv")
    approx = rows[rows["path"] == "approx"]
    # mul8s_1KV6 is the exact signed table: recorded under its one name, exact_s
    assert sorted(approx["multiplier_per_layer"]) == ["conv2=exact_s", "conv2=mul8u_T83",
                                                       "fc3=exact_s", "fc3=mul8u_T83"]
    assert set(approx["scope"]) == {"layer"}
    assert rows["row_key"].is_unique and (approx["status"] == "ok").all()
    # the exact multiplier in one layer, the others fake-quant: the fake-quant model itself
    fq = rows[rows["path"] == "fakequant"]
    exact = approx[approx["multiplier"] == "exact_s"]
    assert (exact["accuracy"] == fq[fq["row_key"].isin(rows["row_key"])]["accuracy"].iloc[0]).all()
    t83 = approx[approx["multiplier"] == "mul8u_T83"]["mult_energy_rel"]
    assert ((t83 < 1) & (t83 > 0.08)).all()                   # one layer of five on the cheap multiplier
    table_csv = next((tmp_path / "results" / "sensitivity").glob("*/sensitivity.csv"))
    table = pd.read_csv(table_csv)
    assert len(table) == 4 and set(table["status"]) == {"ok"}
    assert (table_csv.parent / "sensitivity.png").stat().st_size > 1000     # the heat map
    assert main(args) == 0                                    # a rerun records nothing new
    assert len(pd.read_csv(tmp_path / "results" / "results.csv")) == len(rows)


def test_sensitivity_prefix_cache_leaves_the_rows_unchanged(tmp_path, checkpoints):
    """The layers in forward order, each one's prefix carried on from the one before (runner.session): the
    accuracies equal those of every evaluation run whole."""
    tables = {}
    for cached in ("false", "true"):
        out = tmp_path / cached
        assert main(["sensitivity", "sensitivity.multipliers=[mul8u_T83,mul8s_1L2J]", "sensitivity.plot=false",
                     "sensitivity.layers=[conv2,fc1,fc2,fc3]", f"sensitivity.prefix_cache={cached}",
                     *_args(out, checkpoints)]) == 0
        table = pd.read_csv(next((out / "results" / "sensitivity").glob("*/sensitivity.csv")))
        tables[cached] = table.sort_values(["layer", "multiplier"]).reset_index(drop=True)
    cols = ["layer", "multiplier", "accuracy", "loss_pts"]
    assert len(tables["true"]) == 8 and tables["true"][cols].equals(tables["false"][cols])


@pytest.mark.parametrize("extra, message", [
    (["sensitivity.multipliers=[]"], "sensitivity.multipliers is empty"),
    (["sensitivity.multipliers=mul8s_1KV6", "sensitivity.layers=[conv9]"], "conv9"),
    ([], "needs a multiplier set"),
    (["sensitivity.multipliers=nothing_*"], "matches no multiplier"),
])
def test_sensitivity_bad_input(tmp_path, checkpoints, capsys, extra, message):
    assert main(["sensitivity", *extra, *_args(tmp_path, checkpoints)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1


def test_search_chooses_within_budget_and_prints_the_override(tmp_path, checkpoints, capsys):
    import shlex

    from runner.multipliers import resolve_per_layer

    args = ["search", "search.multipliers=[mul8s_1KV6,mul8u_T83,mul8u_17C8]", "search.layers=[fc2,fc3]",
            "search.max_loss=1.0", *_args(tmp_path, checkpoints)]
    assert main(args) == 0
    out = capsys.readouterr().out
    pareto_csv = next((tmp_path / "results" / "search").glob("*/pareto.csv"))
    table = pd.read_csv(pareto_csv)
    assert (pareto_csv.parent / "pareto.png").stat().st_size > 1000
    chosen = table[table["chosen"]]
    assert len(chosen) >= 1 and (chosen["val_loss_pts"] <= 1.0 + 1e-9).all()
    assert table["on_front"].any() and (table["kind"] == "uniform").sum() == 3
    # every accepted candidate is within budget; every rejected one is not
    cand = table[table["kind"] == "candidate"]
    assert (cand["accepted"].astype(bool) == (cand["val_loss_pts"] <= 1.0 + 1e-9)).all()
    line = next(ln for ln in out.splitlines() if ln.startswith("approx-run compare "))
    cfg = compose("compare", shlex.split(line)[2:])
    picked = resolve_per_layer(cfg.multiplier, ["conv1", "conv2", "fc1", "fc2", "fc3"])
    want = dict(kv.split("=") for kv in chosen["assignment"].iloc[-1].split(";"))
    from runner.multipliers.registry import canonical_name

    assert {n: canonical_name(m) for n, m in picked.items() if n in want} == want    # pareto.csv: recorded names
    assert picked["conv1"].name == "exact_s"                      # layers outside search.layers stay exact
    rows = pd.read_csv(tmp_path / "results" / "results.csv")
    assert (rows["path"] == "approx").sum() == 1                   # the chosen assignment's test row


def test_search_retrains_the_chosen_assignment(tmp_path, checkpoints):
    args = ["search", "search.multipliers=[mul8u_T83]", "search.layers=[fc3]", "search.max_loss=100",
            "search.finetune_epochs=1", *_args(tmp_path, checkpoints)]
    assert main(args) == 0
    rows = pd.read_csv(tmp_path / "results" / "results.csv").set_index("path")
    assert rows.loc["approx", "multiplier_per_layer"] == rows.loc["approx_finetuned", "multiplier_per_layer"]
    assert "fc3=mul8u_T83" in rows.loc["approx", "multiplier_per_layer"]
    assert rows.loc["approx_finetuned", "finetune_epochs"] == 1 and rows.loc["approx_finetuned", "status"] == "ok"


@pytest.mark.parametrize("extra, message", [
    (["search.multipliers=mul8u_T83", "search.max_loss=-1"], "search.max_loss=-1"),
    (["search.multipliers=[]"], "search.multipliers is empty"),
    (["search.multipliers=mul8u_T83", "search.layers=[fc9]"], "fc9"),
    (["search.multipliers=drum4_s"], "no candidate multiplier has a power figure"),
])
def test_search_bad_input(tmp_path, checkpoints, capsys, extra, message):
    assert main(["search", *extra, *_args(tmp_path, checkpoints)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1


def test_sensitivity_operand_metrics_follow_the_layer(tmp_path, checkpoints):
    """Evaluations of one fake-quant model that approximate different layers get their own layer's metrics."""
    import json

    assert main(["sensitivity", "sensitivity.multipliers=mul8u_T83", "sensitivity.layers=[conv1,fc2]",
                 *_args(tmp_path, checkpoints)]) == 0
    runs = sorted((tmp_path / "results" / "sensitivity").glob("*/*_*/run.json"))
    layers = [list(json.loads(r.read_text())["operand_metrics"]) for r in runs]
    assert sorted(layers) == [["conv1"], ["fc2"]]
    rows = pd.read_csv(tmp_path / "results" / "results.csv")
    approx = rows[rows["path"] == "approx"]
    assert approx["op_acc_nrmse"].nunique() == 2


def test_search_override_names_table_files(tmp_path, checkpoints, capsys):
    """A candidate given as a table file comes back as a file node in the override (a table identical to a
    shipped one takes its power figure), and the override composes."""
    import shlex

    import numpy as np

    from runner.multipliers import get, resolve_per_layer

    table = tmp_path / "cheap.txt"
    np.savetxt(table, get("mul8s_1KV8").lut.numpy(), fmt="%d")   # near-exact: always within budget
    args = ["search", f"search.multipliers=[{table}]", "search.layers=[fc3]", "search.max_loss=5",
            *_args(tmp_path, checkpoints)]
    assert main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("approx-run compare "))
    assert f"fc3: {{name: file, path: {table}}}" in line
    picked = resolve_per_layer(compose("compare", shlex.split(line)[2:]).multiplier, ["fc3"])
    assert picked["fc3"].sha256 == get("mul8s_1KV8").sha256


def test_sensitivity_records_a_failing_pair_and_goes_on(tmp_path, checkpoints, capsys):
    bad = tmp_path / "bad_table.txt"
    bad.write_text("1 2 3\n4 5 6\n")
    args = ["sensitivity", f"sensitivity.multipliers=[mul8u_T83,{bad}]", "sensitivity.layers=[fc3]",
            *_args(tmp_path, checkpoints)]
    assert main(args) == 1
    table = pd.read_csv(next((tmp_path / "results" / "sensitivity").glob("*/sensitivity.csv")))
    assert table["status"].tolist() == ["ok", "failed"] and "expected 256" in table["error"].iloc[1]
    assert "1 of 2 evaluations failed" in capsys.readouterr().err


def test_search_evaluator_matches_a_fresh_fakequant_conversion(tmp_path, checkpoints):
    """The evaluator runs exact layers on the exact table and reuses converted models across assignments
    (loading only changed tables); each accuracy must equal a fresh conversion whose other layers are
    fake-quant int8, whatever the order the assignments come in."""
    from runner import session
    from runner.layers import convert_model
    from runner.multipliers import resolve
    from runner.search import Evaluator

    session.reset()
    cfg = compose("search", [*_args(tmp_path, checkpoints), "search.multipliers=[mul8u_T83]"])
    ev = Evaluator(cfg)
    t83, l2n = resolve("mul8u_T83"), resolve("mul8s_1L2N")
    assignments = [{"conv2": t83}, {"fc1": l2n, "conv2": t83}, {"conv1": l2n}, {"conv2": t83}, {}]
    for assign in assignments:
        model = convert_model(ev.folded, {n: assign.get(n, ev.exact) for n in ev.layers}, ev.qcfg, ev.stats,
                              backend="cpp", layers=list(assign) or None, fake=not assign, others="fakequant")
        with torch.no_grad():
            want = int((model(ev.x).argmax(1) == ev.y).sum()) / len(ev.y)
        assert ev.accuracy(assign) == want, assign
    assert len(ev._models) == 3          # fake-quant, all signed, one unsigned layer: tables reloaded in place
    session.reset()


def test_heat_map_of_150_layers_grows_and_stays_drawable(tmp_path):
    import pandas as pd
    from PIL import Image

    from runner.sensitivity import plot_heatmap

    def table(n):
        return pd.DataFrame([{"layer": f"features.{i}.block.0.0", "multiplier": m, "loss_pts": (i % 7) * 0.5,
                              "status": "ok"} for i in range(n) for m in ("mul8s_1L2J", "mul8u_T83")])

    small = plot_heatmap(table(10), tmp_path / "small.png", "10 layers")
    big = plot_heatmap(table(150), tmp_path / "big.png", "150 layers")
    if small is None:
        pytest.skip("matplotlib is not installed")
    h_small, h_big = Image.open(small).size[1], Image.open(big).size[1]
    assert h_big > 5 * h_small  # a row for each layer, not 150 squeezed into one page
    assert h_big < 100 * 150    # yet not the 10-layer row height times 150
