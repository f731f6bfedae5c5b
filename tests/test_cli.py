"""The console script end to end, in subprocesses, as a user runs it."""
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from tests.conftest import REPO, run_cli


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("train", "compare", "sweep", "bench", "results", "lut", "info"):
        assert cmd in out.stdout


def test_command_help_lists_config_groups():
    out = run_cli("train", "--help")
    assert out.returncode == 0 and "mnist5k" in out.stdout and "fashion_mnist" in out.stdout


def test_info_reports_backends():
    out = run_cli("info")
    assert out.returncode == 0 and "backend python" in out.stdout and "backend cpp" in out.stdout


def test_train_end_to_end(tmp_path):
    out = run_cli("train", "train.epochs=1", f"paths.results={tmp_path}/results",
                  f"paths.checkpoints={tmp_path}/ckpt")
    assert out.returncode == 0, out.stderr
    ckpts = list((tmp_path / "ckpt").glob("lenet5_mnist5k-*.pt"))    # <model>_<data>-<data digest>_<config digest>
    assert len(ckpts) == 1
    blob = torch.load(ckpts[0], weights_only=True)
    assert blob["meta"]["test_accuracy"] > 0.5
    run_dirs = list((tmp_path / "results" / "train").iterdir())
    assert len(run_dirs) == 1
    log = pd.read_csv(run_dirs[0] / "train_log.csv")
    assert list(log.columns) == ["epoch", "train_loss", "test_accuracy", "seconds"] and len(log) == 1
    assert (run_dirs[0] / "config.yaml").exists()
    again = run_cli("train", "train.epochs=1", f"paths.results={tmp_path}/results",
                    f"paths.checkpoints={tmp_path}/ckpt")
    assert again.returncode == 0 and "reusing checkpoint" in again.stdout


def test_missing_data_is_exit_2_without_traceback(tmp_path):
    out = run_cli("train", "data=mnist", f"data.root={tmp_path}/none", f"paths.results={tmp_path}/r")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and str(tmp_path / "none") in out.stderr


def test_bad_override_is_exit_2(tmp_path):
    out = run_cli("train", "data=mnist6k", f"paths.results={tmp_path}/r")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "mnist5k" in out.stderr
    out = run_cli("frobnicate")
    assert out.returncode == 2


def test_compare_end_to_end_unsigned_multiplier(tmp_path):
    """Unsigned tables work end to end: conv1 sees raw pixels (normalisation folded), the rest ReLU outputs."""
    out = run_cli("compare", "multiplier=mul8u_17C8", "backend=python", "train.epochs=1", "eval.limit=50",
                  "eval.repeats=1", "eval.warmup=0", f"paths.results={tmp_path}/r", f"paths.checkpoints={tmp_path}/c")
    assert out.returncode == 0, out.stderr
    rows = pd.read_csv(tmp_path / "r" / "results.csv")
    assert rows["path"].tolist() == ["pytorch", "fakequant", "approx"]
    assert (rows["status"] == "ok").all() and rows.loc[2, "multiplier"] == "mul8u_17C8"


def test_lut_commands_end_to_end(tmp_path):
    env = {"APPROX_RUN_HOME": str(tmp_path / "home")}
    out = run_cli("lut", "list", "--csv", str(tmp_path / "luts.csv"), env=env)
    assert out.returncode == 0, out.stderr
    table = pd.read_csv(tmp_path / "luts.csv")
    assert {"mul8s_1L2J", "mul8u_17C8", "exact_s"} <= set(table["name"])
    out = run_cli("lut", "show", "mul8s_1L2J", "--out", str(tmp_path / "heat.png"), env=env)
    assert out.returncode == 0 and (tmp_path / "heat.png").stat().st_size > 1000
    import numpy as np

    a = np.arange(-128, 128)
    np.savetxt(tmp_path / "mine.txt", (a[:, None] * a[None, :]) | 1, fmt="%d")  # LSB forced to 1
    out = run_cli("lut", "import", str(tmp_path / "mine.txt"), "--name", "lsb1", env=env)
    assert out.returncode == 0, out.stderr
    assert "lsb1" in run_cli("lut", "list", env=env).stdout
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 3\n")
    out = run_cli("lut", "import", str(bad), "--name", "bad", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "bad.txt" in out.stderr


@pytest.mark.parametrize("torch_imported", [False, True])
@pytest.mark.parametrize("rc", [3, 130, 143])
def test_fast_exit_once_torch_is_imported_or_interrupted_and_after_exit_handlers(monkeypatch, torch_imported, rc):
    import atexit
    import types

    from runner import cli

    ran, exited = [], []
    if torch_imported:
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())
    else:
        monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: ran.append("atexit"))
    monkeypatch.setattr(os, "_exit", lambda code: exited.append(code))
    cli._exit_now_when_needed(rc)
    fast = torch_imported or rc != 3
    assert exited == ([rc] if fast else [])
    assert ran == (["atexit"] if fast else [])


def test_interrupt_caught_inside_exec_of_a_string_still_exits_130(tmp_path):
    """CPython marks a KeyboardInterrupt raised inside exec() of a string (a dataclass built while torch is
    imported) as unhandled even after we catch it, and a `python -m` process then died by SIGINT (-2):
    Ctrl-C at such a moment of `python -m runner.cli lut import` did so."""
    (tmp_path / "interrupted_main.py").write_text(
        "import sys\n"
        "from runner import cli\n"
        "def interrupted(argv):\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        "        return 130\n"
        "cli._main = interrupted\n"
        "sys.exit(cli.main())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    p = subprocess.run([sys.executable, "-m", "interrupted_main"], env=env, capture_output=True, text=True)
    assert p.returncode == 130, p.stdout + p.stderr


@pytest.mark.parametrize("args, expected", [
    (["backend=cuda"], True),
    (["device=cuda"], True),
    (["sweep.multipliers=mul8*", "backend=cpp,cuda"], True),     # a multirun that includes the GPU
    (["backend=cpp"], False),
    (["device=auto"], False),
    ([], False),
    (["backend=cuda", "hydra/launcher=joblib"], False),          # the jobs run in other processes
    (["backend=cuda", "+hydra/launcher=basic"], True),
])
def test_wants_cuda(args, expected):
    from runner.cli import wants_cuda

    assert wants_cuda(args) is expected


def test_cuda_warm_up_is_harmless_without_a_gpu(monkeypatch):
    """The warm-up thread ends quietly where there is no GPU: the real use reports that, once."""
    from runner.gpus import warm_up_cuda

    thread = warm_up_cuda()
    thread.join(60)
    assert not thread.is_alive()
    monkeypatch.setenv("APPROX_RUN_NO_WARMUP", "1")
    assert warm_up_cuda() is None


@pytest.mark.parametrize("value", ["200MB", "0", " 200", "nan"])
def test_a_bad_table_cache_size_is_exit_2_before_any_work(tmp_path, value):
    """APPROX_RUN_TABLE_CACHE_MB is read by the CUDA kernels; a GPU command checks it first, so a typo is one
    line and exit 2, with nothing written, wherever the run would have gone."""
    out = run_cli("compare", f"paths.results={tmp_path}/r", env={"APPROX_RUN_TABLE_CACHE_MB": value}, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "APPROX_RUN_TABLE_CACHE_MB" in out.stderr and not (tmp_path / "r").exists()


def test_a_table_cache_size_in_mib_is_accepted(monkeypatch):
    from runner.gpus import check_cuda_environment

    for value in ("1", "200", "4096.5", "1e3"):
        monkeypatch.setenv("APPROX_RUN_TABLE_CACHE_MB", value)
        check_cuda_environment()


HELP_COMMANDS = ["train", "compare", "finetune", "bench", "sweep", "sensitivity", "search"]


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_help_lists_every_key_with_its_default_and_one_line(command, capsys):
    """--help shows every key of the command's config (composed here, not taken from the help's own code),
    and a line for each key of the command's own sections, from the config files' comments."""
    from omegaconf import OmegaConf

    from runner.cli import main
    from tests.conftest import compose

    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    lines = {}
    for line in out.splitlines():
        head, _, note = line.strip().partition(" ")
        if "=" in head:
            lines[head.split("=", 1)[0]] = note.strip()

    def flat(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict) and v:
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    keys = [k for k in flat(OmegaConf.to_container(compose(command), resolve=False)) if k != "command"]
    missing = [k for k in keys if k not in lines]
    assert not missing, f"not in `{command} --help`: {missing}"
    own = {"train": "train.", "compare": "eval.", "finetune": "finetune.", "bench": "bench.", "sweep": "sweep.",
           "sensitivity": "sensitivity.", "search": "search."}[command]
    silent = [k for k in keys if k.startswith(own) and not lines[k]]
    assert not silent, f"keys without a line in `{command} --help`: {silent}"


def test_help_lines_come_from_the_config_comments(capsys):
    from runner.cli import main

    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "eval.limit=null" in out and "evaluate only the first N test images" in out
    assert "finetune.epochs=0" in out and "also retrain through the LUT layers" in out   # compare's own default
    assert main(["finetune", "--help"]) == 0
    assert "finetune.epochs=3" in capsys.readouterr().out


def test_a_mistyped_option_is_one_line_with_the_nearest_names(tmp_path):
    out = run_cli("compare", "multiplier=mul8s_1L2X", f"paths.results={tmp_path}/r")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "did you mean" in lines[0] and "mul8s_1L2J" in lines[0], out.stderr
    assert "Available options" not in out.stderr


def test_a_group_the_command_does_not_compose_is_named_as_such(tmp_path):
    """train composes no backend group: the message says so instead of suggesting 'backend' for 'backend'."""
    out = run_cli("train", "backend=cuda", f"paths.checkpoints={tmp_path}/c", f"paths.results={tmp_path}/r")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "does not use the backend config group" in lines[0], out.stderr
    assert "did you mean" not in lines[0]
