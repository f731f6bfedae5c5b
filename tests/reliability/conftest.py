"""Real `approx-run` processes for the reliability tests: started in their own session so a signal
reaches the whole process group (Hydra's joblib workers too), with outputs and user imports in tmp."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import REPO

# The smallest runs that still go through every stage: one training epoch, 200 test images.
TINY = ["train.epochs=1", "eval.limit=200", "eval.repeats=1", "eval.warmup=0", "quant.calib_batches=1"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """User imports in tmp, for this process and the subprocesses it starts."""
    monkeypatch.setenv("APPROX_RUN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="package")
def baseline(tmp_path_factory):
    """The checkpoints dir of one tiny baseline shared by the compare and sweep tests (trained in-process,
    on one thread like the subprocesses: no start-up cost, no contention)."""
    import torch

    from runner.train import load_or_train
    from tests.conftest import compose

    root = tmp_path_factory.mktemp("baseline")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        load_or_train(compose("sweep", [*TINY, *outputs(root)]))
    finally:
        torch.set_num_threads(threads)
    return root / "ckpt"


def outputs(tmp_path: Path, checkpoints: Path | None = None) -> list[str]:
    return [f"paths.results={tmp_path / 'results'}", f"paths.checkpoints={checkpoints or tmp_path / 'ckpt'}"]


def start(*args: str, cwd: Path | None = None) -> subprocess.Popen:
    # one thread each: on a small shared CI machine several OpenMP pools spinning against each other
    # make a 2-second run take 20
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "runner.cli", *args], cwd=cwd or REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"`approx-run {' '.join(p.args[3:])}` hung:\n{out}") from None
    return p.returncode, out


def run(*args: str, timeout: float = 120, cwd: Path | None = None) -> tuple[int, str]:
    return finish(start(*args, cwd=cwd), timeout)


def interrupt_when(p: subprocess.Popen, ready, sig: int, timeout: float = 60) -> tuple[int, str]:
    """Send sig to p's process group once ready() holds (polled), then wait for the exit."""
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None and not ready():
        time.sleep(0.02)
    if p.poll() is None:
        os.killpg(p.pid, sig)
    return finish(p)


def ok_rows(path: Path) -> pd.DataFrame:
    if not path.exists():
        return pd.DataFrame(columns=["row_key", "status", "path"])
    df = pd.read_csv(path)
    return df[df["status"] == "ok"]


def assert_clean_exit(rc: int, out: str, *codes: int) -> None:
    assert rc in codes, f"exit {rc}, expected {codes}:\n{out}"
    assert "Traceback" not in out, out
