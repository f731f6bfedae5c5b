"""`approx-run results`: loading, filtering, sorting, pivot, output formats, plot, and its errors."""
import io
from contextlib import redirect_stdout

import pandas as pd
import pytest

from runner.report import load_results, main, pareto_front, pivot
from runner.store import append_rows, read_csv
from tests.conftest import run_cli


def _rows():
    base = {"data": "mnist5k", "model": "lenet5", "quant": "per_channel_minmax", "status": "ok", "error": ""}
    rows = [
        {**base, "path": "pytorch", "quant": "", "multiplier": "", "backend": "torch", "accuracy": 0.98,
         "row_key": "p"},
        {**base, "path": "fakequant", "multiplier": "exact_s", "backend": "torch", "accuracy": 0.97, "row_key": "fs"},
        {**base, "path": "fakequant", "multiplier": "mul8u_2V0", "backend": "torch", "accuracy": 0.96,
         "row_key": "fu"},
    ]
    for name, signed, acc, mae, pwr in (("exact_s", True, 0.97, 0.0, None), ("mul8s_1KV8", True, 0.965, 0.002, 0.42),
                                        ("mul8s_1L2N", True, 0.90, 0.52, 0.126), ("mul8s_1KVA", True, 0.93, 0.02, 0.39),
                                        ("mul8u_2V0", False, 0.955, 0.0015, 0.386)):
        rows.append({**base, "path": "approx", "multiplier": name, "backend": "cpp", "accuracy": acc,
                     "multiplier_signed": signed, "mult_mae_pct": mae, "published_power_mw": pwr,
                     "latency_ms_median": 10.0, "row_key": f"a-{name}"})
    rows.append({**base, "path": "approx", "multiplier": "bad", "backend": "cpp", "status": "failed",
                 "error": "bad.txt: not a 256x256 table", "row_key": ""})
    return rows


@pytest.fixture
def csv(tmp_path):
    path = tmp_path / "results.csv"
    append_rows(path, _rows())
    return path


def _out(argv) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


def test_where_sort_columns_csv(csv):
    rc, out = _out([str(csv), "--where", "path=='approx' and status=='ok'", "--sort", "accuracy", "--desc",
                    "--columns", "multiplier,accuracy", "--csv"])
    assert rc == 0
    df = pd.read_csv(io.StringIO(out))
    assert list(df.columns) == ["multiplier", "accuracy"]
    assert df["multiplier"].tolist() == ["exact_s", "mul8s_1KV8", "mul8u_2V0", "mul8s_1KVA", "mul8s_1L2N"]


def test_pivot_fills_references_by_signedness(csv):
    table = pivot(read_csv(csv)).set_index("multiplier")
    assert list(table.columns) == ["pytorch", "fakequant", "approx"]
    assert table.loc["mul8s_1L2N"].tolist() == [0.98, 0.97, 0.90]
    assert table.loc["mul8u_2V0"].tolist() == [0.98, 0.96, 0.955]   # the unsigned fakequant reference
    assert "bad" not in table.index                                  # failed rows are not pivoted
    rc, out = _out([str(csv), "--pivot", "--markdown"])
    assert rc == 0 and out.startswith("| multiplier | pytorch | fakequant | approx |")
    assert "| mul8s_1KV8 | 0.9800 | 0.9700 | 0.9650 |" in out


def test_pivot_puts_retrained_rows_beside_approx(tmp_path):
    path = tmp_path / "results.csv"
    base = {"data": "mnist5k", "model": "lenet5", "quant": "per_channel_minmax", "status": "ok", "backend": "cpp",
            "multiplier": "mul8s_1L2N", "multiplier_signed": True}
    extra = [{**base, "path": "approx_finetuned", "accuracy": acc, "finetune_grad": g, "row_key": f"f{g}"}
             for g, acc in (("ste", 0.973), ("lut", 0.975))]
    append_rows(path, _rows() + extra)
    table = pivot(read_csv(path)).set_index("multiplier")
    assert table.loc["mul8s_1L2N", ["approx", "approx_finetuned_lut", "approx_finetuned_ste"]].tolist() == [
        0.90, 0.975, 0.973]
    assert pd.isna(table.loc["mul8s_1KV8", "approx_finetuned_ste"])
    only_ste = pivot(read_csv(path)[lambda d: d["finetune_grad"].fillna("ste") == "ste"])
    assert "approx_finetuned" in only_ste.columns


def test_table_and_file_outputs(csv, tmp_path):
    rc, out = _out([str(csv)])
    assert rc == 0 and "mul8s_1L2N" in out and "not a 256x256" in out
    rc, _ = _out([str(csv), "--markdown", str(tmp_path / "t.md")])
    assert rc == 0 and (tmp_path / "t.md").read_text().count("\n") == 2 + 9
    # a run dir is read through the metrics.csv files below it
    run = tmp_path / "sweep" / "0"
    run.mkdir(parents=True)
    pd.DataFrame(_rows()[:2]).to_csv(run / "metrics.csv", index=False)
    assert len(load_results([str(tmp_path / "sweep")])) == 2


def test_plot_png(csv, tmp_path):
    out = tmp_path / "plot.png"
    rc, text = _out([str(csv), "--plot", str(out)])
    assert rc == 0 and "wrote" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_pareto_front():
    x = [0.0, 0.002, 0.52, 0.02, 0.0015]
    y = [0.97, 0.965, 0.90, 0.93, 0.955]
    assert sorted(pareto_front(x, y)) == [0]
    x = [0.42, 0.126, 0.39, 0.386]        # power: lower is better
    y = [0.965, 0.90, 0.93, 0.955]
    assert sorted(pareto_front(x, y)) == [0, 1, 3]


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing.csv"], "no results file"),
    (["{csv}", "--where", "accuracy >>> 1"], "not a valid pandas query"),
    (["{csv}", "--where", "nosuchcolumn == 1"], "not a valid pandas query"),
    (["{csv}", "--columns", "multiplier,nosuch"], "unknown column(s) nosuch"),
    (["{csv}", "--sort", "nosuch"], "unknown column(s) nosuch"),
])
def test_errors_exit_2(csv, tmp_path, args, message):
    from runner.cli import main as cli_main
    from runner.errors import UserError

    argv = [a.format(tmp=tmp_path, csv=csv) for a in args]
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(argv)
    assert cli_main(["results", *argv]) == 2


def test_cli_subprocess(csv):
    out = run_cli("results", str(csv), "--pivot", "--csv")
    assert out.returncode == 0, out.stderr
    assert pd.read_csv(io.StringIO(out.stdout)).shape == (5, 4)
    bad = run_cli("results", str(csv), "--where", "(")
    assert bad.returncode == 2 and "--where" in bad.stderr and "Traceback" not in bad.stderr


def _scoped_rows():
    """A sweep's network rows, a sensitivity's one-layer rows (which a pivot must not mix in), a search's
    assignment and a retrained row, with the scope column compare writes."""
    layers = ["conv1", "conv2", "fc1", "fc2", "fc3"]
    rows = [{**r, "scope": "reference" if r["path"] != "approx" else "network",
             "multiplier_per_layer": ";".join(f"{n}={r['multiplier']}" for n in layers) if r["path"] == "approx" else ""}
            for r in _rows()]
    base = {"data": "mnist5k", "model": "lenet5", "quant": "per_channel_minmax", "status": "ok", "error": "",
            "backend": "cpp", "path": "approx", "multiplier_signed": True}
    rows += [{**base, "multiplier": "mul8s_1L2N", "scope": "layer", "accuracy": 0.724,
              "multiplier_per_layer": f"{n}=mul8s_1L2N", "row_key": f"l-{n}"} for n in ("conv1", "fc3")]
    rows.append({**base, "multiplier": "mixed", "scope": "assignment", "accuracy": 0.969, "row_key": "s",
                 "multiplier_per_layer": "conv1=mul8u_T83;conv2=mul8s_1L2N;fc1=exact_s;fc2=exact_s;fc3=exact_s"})
    rows.append({**base, "multiplier": "mul8s_1L2N", "path": "approx_finetuned", "scope": "finetuned",
                 "accuracy": 0.976, "finetune_grad": "ste", "row_key": "f",
                 "multiplier_per_layer": ";".join(f"{n}=mul8s_1L2N" for n in layers)})
    return rows


def _err(argv) -> tuple[int, str, str]:
    from contextlib import redirect_stderr

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_default_views_are_whole_network_rows_and_say_what_they_left_out(tmp_path):
    path = tmp_path / "results.csv"
    append_rows(path, _scoped_rows())
    rc, out, err = _err([str(path), "--pivot", "--markdown"])
    assert rc == 0
    table = pd.read_csv(io.StringIO(_err([str(path), "--pivot", "--csv"])[1])).set_index("multiplier")
    assert table.loc["mul8s_1L2N", "approx"] == 0.90          # the network row, not a one-layer row (0.724)
    assert "mixed" not in table.index and "approx_finetuned" not in table.columns
    assert "left out 1 assignment, 1 finetuned, 2 layer rows" in err and "--scope all" in err
    assert "left out" not in out                              # stdout stays a clean table
    everything = pd.read_csv(io.StringIO(_err([str(path), "--scope", "all", "--csv"])[1]))
    assert len(everything) == len(_scoped_rows())
    rc, out, err = _err([str(path), "--scope", "network,finetuned", "--pivot", "--csv"])
    both = pd.read_csv(io.StringIO(out)).set_index("multiplier")
    assert both.loc["mul8s_1L2N", ["approx", "approx_finetuned"]].tolist() == [0.90, 0.976]
    layer = pd.read_csv(io.StringIO(_err([str(path), "--scope", "layer", "--pivot", "--csv"])[1]))
    assert sorted(layer["layers"]) == ["conv1=mul8s_1L2N", "fc3=mul8s_1L2N"]   # one line per layer, not merged
    assert set(layer["approx"]) == {0.724}


def test_scope_of_rows_written_before_the_column(tmp_path):
    from runner.report import with_scope

    rows = [{k: v for k, v in r.items() if k != "scope"} for r in _scoped_rows()]
    inferred = with_scope(pd.DataFrame(rows))
    assert inferred["scope"].tolist() == [r["scope"] for r in _scoped_rows()]
    old = tmp_path / "old.csv"
    pd.DataFrame(rows).to_csv(old, index=False)               # an old file: no scope column at all
    rc, out, err = _err([str(old), "--pivot", "--csv"])
    assert rc == 0 and pd.read_csv(io.StringIO(out)).set_index("multiplier").loc["mul8s_1L2N", "approx"] == 0.90


def test_plot_takes_one_scope(tmp_path):
    from runner.errors import UserError

    path = tmp_path / "results.csv"
    append_rows(path, _scoped_rows())
    rc, _, _ = _err([str(path), "--plot", str(tmp_path / "p.png")])
    assert rc == 0 and (tmp_path / "p.png").exists()
    with pytest.raises(UserError, match="one scope at a time"):
        main([str(path), "--scope", "all", "--plot", str(tmp_path / "q.png")])


@pytest.mark.parametrize("args, message", [
    (["--scope", "layr"], "--scope layr: unknown layr; choose from network, layer"),
    (["--scope", ","], "--scope ,: empty"),
    (["--pivto"], "did you mean --pivot"),
])
def test_new_options_bad_input_exit_2(csv, args, message):
    from contextlib import redirect_stderr

    from runner.cli import main as cli_main

    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        assert cli_main(["results", str(csv), *args]) == 2
    assert message in err.getvalue().replace("\n", " ") and "Traceback" not in err.getvalue()
