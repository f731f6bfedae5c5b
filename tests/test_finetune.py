"""`approx-run finetune` and retraining in compare/sweep: rows, checkpoints, reuse, bad input, interrupts."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from runner.errors import UserError
from runner.finetune import FinetuneConfig
from tests.conftest import REPO, compose, has_cpp, run_cli

pytestmark = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")

FAST = ["eval.limit=200", "eval.repeats=1", "eval.warmup=0", "train.epochs=1", "quant.calib_batches=1",
        "finetune.epochs=1", "finetune.batch_size=256"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One baseline for every test here (trained in-process)."""
    from runner.train import load_or_train

    root = tmp_path_factory.mktemp("finetune_ckpt")
    load_or_train(compose("finetune", [*FAST, f"paths.checkpoints={root}", f"paths.results={root / 'r'}"]))
    return root


def _args(tmp_path, checkpoints, *extra):
    return ["finetune", *FAST, f"paths.results={tmp_path / 'results'}", f"paths.checkpoints={checkpoints}", *extra]


def _finetuned_ckpts(checkpoints: Path):
    return sorted(checkpoints.glob("*_finetuned_*.pt"))


def test_config_validation():
    assert FinetuneConfig().grad == "ste"
    for bad, match in (({"grad": "exact"}, "finetune.grad"), ({"optimizer": "lbfgs"}, "finetune.optimizer"),
                       ({"lr": 0}, "finetune.lr"), ({"batch_size": 0}, "batch_size"),
                       ({"recalibrate": "always"}, "finetune.recalibrate"), ({"epochs": -1}, "finetune.epochs")):
        with pytest.raises(UserError, match=match):
            FinetuneConfig(**bad)
    with pytest.raises(UserError, match="unknown finetune setting"):
        FinetuneConfig.from_cfg({"epoch": 3})


def test_row_key_includes_the_finetune_settings(tmp_path):
    from runner.compare import plan

    keys = [plan(compose("compare", ["backend=python", *extra], tmp_path))[3]
            for extra in ([], ["finetune.epochs=2"], ["finetune.epochs=2", "finetune.grad=lut"],
                          ["finetune.epochs=3"])]
    assert "approx_finetuned" not in keys[0]                       # compare: off by default
    assert keys[0]["approx"] == keys[1]["approx"] == keys[2]["approx"]
    assert len({k["approx_finetuned"] for k in keys[1:]}) == 3


def test_finetune_end_to_end_and_reuse(tmp_path, checkpoints):
    res = run_cli(*_args(tmp_path, checkpoints, "multiplier=mul8s_1L2N"))
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    assert df["path"].tolist() == ["pytorch", "fakequant", "approx", "approx_finetuned"]
    approx, tuned = df.iloc[2], df.iloc[3]
    assert approx["multiplier"] == tuned["multiplier"] == "mul8s_1L2N"
    assert approx["lut_sha256"] == tuned["lut_sha256"] and tuned["status"] == "ok"
    assert tuned["finetune_grad"] == "ste" and tuned["finetune_epochs"] == 1 and tuned["finetune_epoch_s"] > 0
    assert pd.isna(approx["finetune_epochs"])
    assert tuned["accuracy"] > approx["accuracy"]                  # one epoch already recovers accuracy
    run_dir = Path(tuned["run_dir"])
    log = pd.read_csv(run_dir / "finetune_log.csv")
    assert log.columns.tolist()[:4] == ["epoch", "train_loss", "train_accuracy", "epoch_s"] and len(log) == 1
    ckpts = _finetuned_ckpts(checkpoints)
    assert [Path(tuned["finetune_checkpoint"])] == ckpts
    # the rerun reuses the retrained checkpoint: no training, the same accuracy
    mtime = ckpts[0].stat().st_mtime
    again = run_cli(*_args(tmp_path, checkpoints, "multiplier=mul8s_1L2N"))
    assert again.returncode == 0 and "reusing retrained checkpoint" in again.stdout
    assert ckpts[0].stat().st_mtime == mtime
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    assert df["accuracy"].iloc[-1] == tuned["accuracy"]
    again_dir = Path(df["run_dir"].iloc[-1])                       # its run dir still gets the epoch log
    assert again_dir != run_dir and pd.read_csv(again_dir / "finetune_log.csv").equals(log)


@pytest.mark.parametrize("override,message", [
    ("finetune.epochs=0", "needs at least one epoch"),
    ("finetune.grad=exact", "finetune.grad='exact': choose ste or lut"),
    ("backend=cuda", "backend=cuda is not usable here"),
])
def test_bad_input_exits_2(tmp_path, checkpoints, override, message):
    before = _finetuned_ckpts(checkpoints)
    res = run_cli(*_args(tmp_path, checkpoints, override))
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr + res.stdout
    assert _finetuned_ckpts(checkpoints) == before
    assert not (tmp_path / "results" / "results.csv").exists()


def test_interrupted_finetune_leaves_no_checkpoint(tmp_path):
    """Ctrl-C while retraining: exit 130, no retrained checkpoint (not even a temp file); the rerun completes."""
    ckpt = tmp_path / "ckpt"
    args = _args(tmp_path, ckpt, "finetune.epochs=50", "multiplier=mul8s_1L2J")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "runner.cli", *args], cwd=REPO, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    for line in p.stdout:
        if line.startswith("finetune ") or time.time() > deadline:
            break
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 130, out
    assert "Traceback" not in out
    assert not _finetuned_ckpts(ckpt) and not list(ckpt.glob(".*tmp"))
    results = tmp_path / "results" / "results.csv"
    assert not results.exists() or "approx_finetuned" not in pd.read_csv(results)["path"].tolist()
    res = run_cli(*args[:-2], "finetune.epochs=1", "multiplier=mul8s_1L2J")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(_finetuned_ckpts(ckpt)) == 1


def test_sweep_adds_a_finetuned_row_per_job_and_resumes(tmp_path, checkpoints):
    args = ["sweep", "sweep.multipliers=[mul8s_1L2N,mul8u_T83]", *FAST, f"paths.results={tmp_path / 'results'}",
            f"paths.checkpoints={checkpoints}", "+multiplier.layers={fc1: mul8s_1L2J}"]
    res = run_cli(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    tuned = df[df["path"] == "approx_finetuned"]
    assert sorted(tuned["multiplier"]) == ["mixed", "mixed"] and tuned["row_key"].is_unique
    assert all("fc1=mul8s_1L2J" in s for s in tuned["multiplier_per_layer"])
    summary = pd.read_csv(sorted((tmp_path / "results" / "sweep").iterdir())[-1] / "summary.csv")
    assert summary["finetuned_accuracy"].notna().all()
    again = run_cli(*args)
    assert again.returncode == 0
    assert len(pd.read_csv(tmp_path / "results" / "results.csv")) == len(df)   # resumed: nothing redone


@pytest.mark.parametrize("mode", ["none", "end"])
def test_train_epochs_recalibrates_at_the_end(mode):
    """`recalibrate=end` belongs to the training loop, so every caller (the command, the tuning benchmark)
    gets the scales of the retrained weights; `none` keeps the calibrated ones."""
    import copy

    import torch

    from runner.data import Dataset
    from runner.finetune import train_epochs
    from runner.layers import quantized_models, recalibrate
    from runner.models import LeNet5
    from runner.multipliers import resolve
    from runner.quant import QuantConfig

    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 28, 28, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    data = Dataset("tiny", x, y, x[:8], y[:8], 0.1307, 0.3081, "random")
    q = QuantConfig(calib_batches=1, calib_batch_size=64)
    torch.manual_seed(0)
    _, approx, _ = quantized_models(LeNet5(mean=0.1307, std=0.3081), resolve("exact"), q, x)
    before = approx.fc2.act_scale.clone()
    fcfg = FinetuneConfig(epochs=1, lr=0.05, batch_size=32, learn_scales=False, recalibrate=mode)
    train_epochs(approx, data, fcfg, q, torch.device("cpu"), 0, "tiny")
    expected = copy.deepcopy(approx)
    recalibrate(expected, x, q)
    assert not torch.equal(expected.fc2.act_scale, before)   # training moved the activations
    assert torch.equal(approx.fc2.act_scale, expected.fc2.act_scale if mode == "end" else before)
