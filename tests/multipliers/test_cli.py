import csv

from runner.multipliers import get, save_table
from runner.multipliers.cli import main


def test_list_and_csv(tmp_path, capsys):
    out = tmp_path / "lut.csv"
    assert main(["list", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mul8s_1L2J" in text and "drum4_s" in text
    rows = list(csv.DictReader(open(out)))
    by = {r["name"]: r for r in rows}
    assert len(rows) >= 29 and by["mul8s_1L12"]["pwr"] == "0.052" and by["mul8u_T83"]["signed"] == "False"
    assert float(by["exact_s"]["mae_pct"]) == 0 and by["mul8s_1KVM"]["kind"] == "EvoApproxLib"


def test_show_writes_heatmap(tmp_path, capsys):
    png = tmp_path / "h.png"
    assert main(["show", "mul8s_1KVP", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "0.051" in text and "mae_pct" in text and "0.363" in text  # published MAE% and power


def test_show_default_path_and_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["show", "bam_h0v8_u"]) == 0
    assert (tmp_path / "results" / "lut" / "bam_h0v8_u_error.png").is_file()
    save_table(get("mitchell_s"), tmp_path / "m.txt")
    assert main(["show", str(tmp_path / "m.txt"), "--no-plot"]) == 0


def test_import_then_list(tmp_path, capsys):
    save_table(get("mul8u_NLX"), tmp_path / "nlx.txt")
    assert main(["import", str(tmp_path / "nlx.txt"), "--name", "nlx_copy", "--unsigned"]) == 0
    out = capsys.readouterr().out
    assert "imported nlx_copy (unsigned)" in out and "identical to shipped mul8u_NLX" in out
    assert main(["list"]) == 0
    assert "nlx_copy" in capsys.readouterr().out
    assert main(["show", "nlx_copy", "--no-plot"]) == 0


def test_errors_exit_2(tmp_path, capsys):
    assert main(["show", "nope_mul"]) == 2
    assert "unknown multiplier" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("")
    assert main(["import", str(tmp_path / "empty.txt"), "--name", "e"]) == 2
    assert "empty file" in capsys.readouterr().err
    save_table(get("mul8u_NLX"), tmp_path / "u.txt")
    assert main(["import", str(tmp_path / "u.txt"), "--name", "u", "--signed"]) == 2
    assert "--unsigned" in capsys.readouterr().err
    assert main(["bogus"]) == 2
    assert main(["import", "x.txt"]) == 2  # --name missing
    assert main(["--help"]) == 0
