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

    flags, _, _, cfgs = sweep.plan_jobs(argv)
    assert not flags
    return cfgs


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
