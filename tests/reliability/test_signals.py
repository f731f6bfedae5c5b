"""SIGINT and SIGKILL at seeded random moments of real `approx-run` processes: no half-written
checkpoint, table or results file; every finished row kept; the rerun completes with each row once."""
import signal
import time

import numpy as np
import pandas as pd
import pytest
import torch

from runner.store import read_csv
from tests.reliability.conftest import TINY, assert_clean_exit, interrupt_when, ok_rows, outputs, run, start

pytestmark = pytest.mark.processes

SIGNALS = [signal.SIGINT, signal.SIGKILL]
NAMES = ["SIGINT", "SIGKILL"]


def _checkpoints_whole(ckpt_dir):
    for pt in ckpt_dir.glob("*.pt"):
        blob = torch.load(pt, weights_only=True)       # a torn file fails here
        assert "state_dict" in blob and blob["meta"]["test_accuracy"] > 0


def _interrupted(sig, rc, out):
    """A process that was still running when the signal came: SIGINT exits with the resume hint and
    no traceback, SIGKILL -9; one that had already finished exited 0."""
    if rc == 0:
        return False
    if sig == signal.SIGINT:
        # 130, or CPython's own re-raise of SIGINT at exit (-2 here), which a shell also reports as 130
        assert_clean_exit(rc, out, 130, -signal.SIGINT)
        assert "interrupted: finished results are kept" in out
    elif sig == signal.SIGTERM:                        # a scheduler's stop: like Ctrl-C, exit 143
        assert_clean_exit(rc, out, 143)
        assert "interrupted: finished results are kept" in out
    else:
        assert rc == -signal.SIGKILL
    return True



@pytest.mark.parametrize("sig", SIGNALS, ids=NAMES)
def test_train(tmp_path, sig):
    rng = np.random.default_rng(int(sig))
    args = ["train", "train.epochs=2", *outputs(tmp_path)]
    for _ in range(2):  # two moments: start-up or data loading, then (likely) mid-training or saving
        p = start(*args)
        rc, out = interrupt_when(p, lambda t=time.time() + rng.uniform(2.0, 6.0): time.time() > t, sig)
        _interrupted(sig, rc, out)
        _checkpoints_whole(tmp_path / "ckpt")
    rc, out = run(*args)
    assert_clean_exit(rc, out, 0)
    assert len(list((tmp_path / "ckpt").glob("*.pt"))) == 1
    _checkpoints_whole(tmp_path / "ckpt")


@pytest.mark.parametrize("sig", [*SIGNALS, signal.SIGTERM], ids=[*NAMES, "SIGTERM"])
def test_compare(tmp_path, baseline, sig):
    args = ["compare", *TINY, *outputs(tmp_path, baseline)]
    results = tmp_path / "results" / "results.csv"
    rng = np.random.default_rng(int(sig))
    p = start(*args)
    rc, out = interrupt_when(p, lambda t=time.time() + rng.uniform(1.2, 3.0): time.time() > t, sig)
    stopped = _interrupted(sig, rc, out)
    before = read_csv(results)                           # absent or whole: read_csv refuses a torn file
    assert len(before) in (0, 3) if stopped else len(before) == 3
    rc, out = run(*args)
    assert_clean_exit(rc, out, 0)
    after = read_csv(results)
    assert len(after) == len(before) + 3                              # earlier rows kept, as they were
    assert after["row_key"].tolist()[: len(before)] == before.get("row_key", pd.Series(dtype=str)).tolist()


# enough jobs (a few tenths of a second each) that a random moment after the first row falls inside the sweep
SWEPT = ["exact", "mul8s_1KV8", "mul8s_1KV9", "mul8s_1L2N", "mul8s_1KVA", "mul8s_1KVM", "mul8s_1KVP", "mul8s_1KVQ"]


def _sweep_args(tmp_path, baseline, launcher):
    extra = {"joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
             "pool": ["sweep.devices=[cpu,cpu]"]}.get(launcher, [])  # pool: a worker process beside this one
    return ["sweep", f"sweep.multipliers=[{','.join(SWEPT)}]", *TINY,
            *outputs(tmp_path, baseline), *extra]


@pytest.mark.parametrize("launcher, sig", [("basic", signal.SIGINT), ("basic", signal.SIGKILL),
                                           ("joblib", signal.SIGINT), ("joblib", signal.SIGKILL),
                                           ("pool", signal.SIGINT), ("pool", signal.SIGKILL)],
                         ids=["basic-SIGINT", "basic-SIGKILL", "joblib-SIGINT", "joblib-SIGKILL", "pool-SIGINT",
                              "pool-SIGKILL"])
def test_sweep(tmp_path, baseline, launcher, sig):
    if launcher == "joblib":
        pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    args = _sweep_args(tmp_path, baseline, launcher)
    results = tmp_path / "results" / "results.csv"
    p = start(*args)
    # a seeded random moment after the first approx row is in: the signal lands mid-sweep (with joblib,
    # while a second job runs), at a different point of the job that follows for each case
    delay = np.random.default_rng(int(sig) + len(launcher)).uniform(0.0, 0.05)
    first_row_at = []

    def ready():
        if not first_row_at and (ok_rows(results)["path"] == "approx").sum() >= 1:
            first_row_at.append(time.time())
        return bool(first_row_at) and time.time() >= first_row_at[0] + delay

    rc, out = interrupt_when(p, ready, sig, timeout=90)
    assert _interrupted(sig, rc, out), f"the sweep finished before the signal:\n{out}"
    first = ok_rows(results)
    assert 1 <= (first["path"] == "approx").sum() < len(SWEPT)
    rc, out = run(*args, timeout=180)
    assert_clean_exit(rc, out, 0)
    ok = ok_rows(results)
    assert ok["row_key"].is_unique                                    # each row once
    assert set(first["row_key"]) <= set(ok["row_key"])                # every finished row kept
    assert (ok["path"] == "approx").sum() == len(SWEPT) and len(pd.read_csv(results)) == len(ok)


def test_stale_temp_files_of_killed_writers_are_removed(tmp_path):
    import os

    from runner.provenance import STALE_TEMP_S, atomic_write_bytes

    target = tmp_path / "results.csv"
    dead, live = tmp_path / ".results.csv.dead.tmp", tmp_path / ".results.csv.live.tmp"
    for f in (dead, live):
        f.write_bytes(b"row_key,sta")                                   # what a SIGKILL mid-write leaves
    old = time.time() - STALE_TEMP_S - 1
    os.utime(dead, (old, old))
    atomic_write_bytes(target, b"row_key,status\n")
    assert not dead.exists() and live.exists()                          # a writer may still own a fresh one
