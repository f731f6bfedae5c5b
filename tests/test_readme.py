"""Every `approx-run` command the README shows works as written: Hydra commands and sweeps compose (a
typo in an override, a group option that no longer exists or an unknown multiplier fails here), and the
cheap commands (results, lut, info) run for real on a small results file."""
import io
import re
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.conftest import REPO, compose
from tests.test_report import _rows

HYDRA = {"train", "compare", "finetune", "bench"}


def readme_commands(path: Path = REPO / "README.md") -> list[list[str]]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.splitlines():
            line = line.split(" && ")[-1].strip()          # `./install.sh && <command>`
            if not re.match(r"(\.venv/bin/)?approx-run ", line):
                continue
            argv = shlex.split(line, comments=True)
            commands.append(argv[1:])
    return commands


COMMANDS = readme_commands()


def test_readme_shows_commands():
    assert {argv[0] for argv in COMMANDS} >= {"sweep", "results", "finetune"}


def _sweep_job_configs(argv: list[str]):
    from runner import sweep

    flags, _, jobs = sweep.sweep_jobs(argv)
    assert not flags
    return [job.cfg for job in jobs]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a) for a in COMMANDS])
def test_readme_command(argv, tmp_path, monkeypatch):
    command, args = argv[0], argv[1:]
    if command in HYDRA:
        cfg = compose(command, args, tmp_path)
        assert cfg.paths.results == str(tmp_path / "results")
    elif command == "sweep":
        assert _sweep_job_configs(args)
    else:  # cheap: run it, in a scratch directory holding a small results file
        from runner.cli import main
        from runner.store import append_rows

        monkeypatch.chdir(tmp_path)
        append_rows(tmp_path / "results" / "results.csv", _rows())
        (tmp_path / "docs" / "img").mkdir(parents=True)
        with redirect_stdout(io.StringIO()):
            assert main(argv) == 0


@pytest.mark.slow  # 2 min 45 s of CPU (8 min wall on the shared 2-core machine)
def test_readme_workflow_in_order_gives_the_readme_tables(tmp_path, monkeypatch):
    """sweep, sensitivity, search, finetune, then `results --pivot --markdown` and `--plot`, as the README
    runs them (three tables, a short baseline): the pivot's approx column is each table's whole-network
    sweep row, and no one-layer (sensitivity) or searched-assignment row is in it."""
    import pandas as pd

    from runner import session
    from runner.cli import main
    from tests.conftest import has_cpp

    if not has_cpp():
        pytest.skip("needs the C++ extension (backend=cpp)")
    monkeypatch.chdir(tmp_path)                    # the README's commands write results/ and checkpoints/ here
    tables = ["exact", "mul8u_T83", "mul8s_1L2N"]
    common = ["train.epochs=2", "eval.repeats=1", "eval.warmup=0"]
    listed = f"[{','.join(tables)}]"
    for argv in (["sweep", f"sweep.multipliers={listed}"],
                 ["sensitivity", f"sensitivity.multipliers={listed}"],
                 ["search", f"search.multipliers={listed}"],
                 ["finetune", "multiplier=mul8u_T83", "finetune.epochs=1"]):
        session.reset()
        with redirect_stdout(io.StringIO()):
            assert main([*argv, *common]) == 0, argv
    session.reset()
    summary = pd.read_csv(next((tmp_path / "results" / "sweep").glob("*/summary.csv")))
    swept = dict(zip(summary["multiplier"], summary["accuracy"]))
    assert set(swept) == {"exact_s", "mul8u_T83", "mul8s_1L2N"}              # one name per table
    rows = pd.read_csv(tmp_path / "results" / "results.csv")
    assert {"network", "layer", "finetuned", "reference"} <= set(rows["scope"])

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["results", "--pivot", "--markdown"]) == 0
    lines = [line.strip("|").split("|") for line in out.getvalue().splitlines()]
    header = [c.strip() for c in lines[0]]
    assert header == ["multiplier", "pytorch", "fakequant", "approx"]       # no layers column, no retrained one
    pivot = {cells[0].strip(): float(cells[header.index("approx")]) for cells in lines[2:]}
    assert pivot == {name: round(acc, 4) for name, acc in swept.items()}   # exactly the sweep's rows
    with redirect_stdout(io.StringIO()):
        assert main(["results", "--plot", "sweep.png"]) == 0
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
