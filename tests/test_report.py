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
