"""`approx-run sweep`: expansion, shared baseline/reference rows, failed jobs, resume after a kill,
concurrent sweeps into one results file. Small and fast: 200 test images, one timed pass."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from runner.errors import UserError
from runner.jobs.argv import expand_jobs, expand_multipliers
from tests.conftest import REPO, compose, has_cpp

pytestmark = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")

FAST = ["eval.limit=200", "eval.repeats=1", "eval.warmup=0", "train.epochs=1", "quant.calib_batches=1"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One baseline for every test here (trained in-process: no subprocess start-up)."""
    from runner.train import load_or_train

    root = tmp_path_factory.mktemp("sweep_ckpt")
    cfg = compose("sweep", [*FAST, f"paths.checkpoints={root}", f"paths.results={root / 'r'}"])
    load_or_train(cfg)
    return root


def _args(tmp_path: Path, checkpoints: Path, multipliers: str, *extra: str) -> list[str]:
    return ["sweep", f"sweep.multipliers={multipliers}", *FAST, f"paths.results={tmp_path / 'results'}",
            f"paths.checkpoints={checkpoints}", *extra]


def _popen(args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "runner.cli", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _run(args, timeout=300):
    p = _popen(args)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _ok_rows(path: Path) -> pd.DataFrame:
    df = pd.read_csv(path)
    return df[df["status"] == "ok"]


def _summary(tmp_path: Path) -> pd.DataFrame:
    dirs = sorted((tmp_path / "results" / "sweep").iterdir())
    return pd.read_csv(dirs[-1] / "summary.csv")


def test_expand_multipliers(tmp_path, monkeypatch):
    unsigned = expand_multipliers("'mul8u_*'")
    assert len(unsigned) == 37 and unsigned[:4] == ["mul8u_0AB", "mul8u_12KA", "mul8u_12YX", "mul8u_17C8"]
    assert len(expand_multipliers("mul8*")) == 50
    assert expand_multipliers("[exact, drum4_s,exact]") == ["exact", "drum4_s"]
    assert expand_multipliers(f"{tmp_path}/t.txt") == [str(tmp_path / "t.txt")]
    # A bare file name is a table file exactly when the table loader reads its suffix.
    monkeypatch.chdir(tmp_path)
    for name in ("t.txt", "t.TXT", "t.txt.gz", "t.npy", "t.c", "t.v", "t.bin", "t.h"):
        assert expand_multipliers(name) == [str(tmp_path / name)]
    for name in ("t.gz", "t.csv"):
        with pytest.raises(UserError, match="unknown multiplier"):
            expand_multipliers(name)
    with pytest.raises(UserError, match="Did you mean"):
        expand_multipliers("mul8s_1KV7")
    with pytest.raises(UserError, match="matches no multiplier"):
        expand_multipliers("nothing_*")
    jobs = expand_jobs(["sweep.multiplier='a','b'", "quant=per_channel_minmax,per_tensor_minmax", "seed=1",
                        "hydra/launcher=joblib"])
    assert len(jobs) == 4 and all("seed=1" in j for j in jobs)


def test_sweep_three_multipliers_and_a_bad_table(tmp_path, checkpoints):
    bad = tmp_path / "bad_table.txt"
    bad.write_text("1 2 3\n4 5 6\n")
    args = _args(tmp_path, checkpoints, f"[mul8s_1KV8,mul8s_1L2N,mul8u_2V0,{bad}]")
    rc, out = _run(args)
    assert rc == 1 and "1 of 4 jobs failed" in out, out      # recorded and reported, and the exit code says so
    results = tmp_path / "results" / "results.csv"
    df = pd.read_csv(results)
    ok = df[df["status"] == "ok"]
    assert sorted(ok.loc[ok["path"] == "approx", "multiplier"]) == ["mul8s_1KV8", "mul8s_1L2N", "mul8u_2V0"]
    # references once per (data, model, quant, signedness), not per multiplier
    assert (ok["path"] == "pytorch").sum() == 1 and (ok["path"] == "fakequant").sum() == 2
    assert ok["row_key"].is_unique
    failed = df[df["status"] == "failed"]
    assert len(failed) == 1 and "bad_table.txt" in failed["error"].iloc[0]
    summary = _summary(tmp_path)
    assert summary["status"].tolist() == ["ok", "ok", "ok", "failed"]
    assert summary["accuracy"].iloc[:3].notna().all() and summary["fp32_accuracy"].iloc[:3].notna().all()
    sweep_dir = Path(summary["job_dir"].iloc[0]).parent
    assert [(sweep_dir / str(i) / "job.json").is_file() for i in range(4)] == [True] * 4
    assert (sweep_dir / "0" / "metrics.csv").is_file() and (sweep_dir / "0" / "run.json").is_file()


def test_jobs_sharing_a_converted_model_equal_separate_compare_runs(tmp_path, checkpoints):
    """A sweep converts the model once and loads each job's tables into it: each job's row must be what a
    compare run of that multiplier alone gives (a table left behind by the job before would show here)."""
    from runner import session
    from runner.cli import _main

    names = ["mul8s_1L2N", "mul8s_1KX5", "mul8s_1KV9"]
    session.reset()
    assert _main(_args(tmp_path, checkpoints, ",".join(names))) == 0
    swept = _ok_rows(tmp_path / "results" / "results.csv").set_index("multiplier")
    for name in names:
        session.reset()
        out = tmp_path / name
        assert _main(["compare", f"multiplier={name}", *FAST, f"paths.results={out}",
                      f"paths.checkpoints={checkpoints}"]) == 0
        alone = _ok_rows(out / "results.csv").set_index("path").loc["approx"]
        row = swept[swept["path"] == "approx"].loc[name]
        assert (row["correct"], row["agreement_fakequant"]) == (alone["correct"], alone["agreement_fakequant"])
    session.reset()


# what differs between two runs of the same evaluation: when and where it ran, and its timings
RUN_COLUMNS = {"timestamp", "run_dir", "latency_ms_median", "testset_ms_median", "throughput_img_s", "elapsed_s"}


def test_sweep_rows_equal_rows_of_jobs_composed_alone(tmp_path, checkpoints):
    """The in-process sweep (one composition for the jobs, resolved configs, plans made before the jobs,
    reference rows in prepare) records the rows each job records when composed and run by itself, as a
    launcher's process runs it: the same row keys, every column equal but the run's time and place."""
    from runner import session
    from runner.cli import _main
    from runner.jobs.run import run_job

    names = "mul8s_1L2N,mul8u_2V0,mul8s_1KV9"  # both signednesses: two fake-quant references
    session.reset()
    assert _main(_args(tmp_path, checkpoints, names)) == 0
    swept = pd.read_csv(tmp_path / "results" / "results.csv", dtype=str, keep_default_na=False)
    alone_dir = tmp_path / "alone"
    for num, job in enumerate(expand_jobs([f"sweep.multiplier={names}", *FAST])):
        session.reset()
        cfg = compose("sweep", [*job, f"paths.results={alone_dir}", f"paths.checkpoints={checkpoints}"])
        assert run_job(cfg, alone_dir / str(num))["status"] == "ok"
    session.reset()
    alone = pd.read_csv(alone_dir / "results.csv", dtype=str, keep_default_na=False)
    assert len(swept) == len(alone) == 6 and (swept["status"] == "ok").all()
    assert sorted(swept["row_key"]) == sorted(alone["row_key"])
    assert sorted(swept.columns) == sorted(alone.columns)
    columns = sorted(set(swept.columns) - RUN_COLUMNS)
    a = swept.set_index("row_key").loc[sorted(swept["row_key"]), [c for c in columns if c != "row_key"]]
    b = alone.set_index("row_key").loc[sorted(alone["row_key"]), [c for c in columns if c != "row_key"]]
    assert a.to_dict("index") == b.to_dict("index")


def test_resume_after_kill(tmp_path, checkpoints):
    names = ["exact", "mul8s_1KV8", "mul8s_1KV9", "mul8s_1KVA"]
    args = _args(tmp_path, checkpoints, ",".join(names))
    results = tmp_path / "results" / "results.csv"
    p = _popen(args)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if results.exists() and (_ok_rows(results)["path"] == "approx").sum() >= 1:
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate()
    first = _ok_rows(results)
    assert 1 <= (first["path"] == "approx").sum() < len(names), "the kill should land mid-sweep"
    rc, out = _run(args)
    assert rc == 0, out
    ok = _ok_rows(results)
    assert ok["row_key"].is_unique                                  # nothing duplicated
    assert set(first["row_key"]) <= set(ok["row_key"])              # nothing lost
    assert (ok["path"] == "approx").sum() == len(names)
    summary = _summary(tmp_path)                                  # the rerun's
    assert (summary["status"] == "skipped").sum() == (first["path"] == "approx").sum()   # done: not redone
    assert (summary["status"] == "ok").sum() == len(names) - (first["path"] == "approx").sum()
    assert summary["accuracy"].notna().all()
    skipped, fresh = summary[summary["status"] == "skipped"], summary[summary["status"] == "ok"]
    # a skipped job shows the numbers recorded earlier, when, and no latency of that earlier run
    assert skipped["recorded_at"].notna().all() and skipped["latency_ms_median"].isna().all()
    assert fresh["latency_ms_median"].notna().all()
    recorded = first.set_index("row_key")["timestamp"]
    assert (skipped["recorded_at"] == skipped["row_key"].map(recorded)).all()


def test_two_concurrent_sweeps_share_a_results_file(tmp_path, checkpoints):
    a = _popen(_args(tmp_path, checkpoints, "exact,mul8s_1KV8,mul8s_1KV9"))
    b = _popen(_args(tmp_path, checkpoints, "mul8s_1KV8,mul8s_1KV9,mul8s_1KVA",
                     f"hydra.sweep.dir={tmp_path / 'results' / 'sweep' / 'b'}"))
    out_a, _ = a.communicate(timeout=300)
    out_b, _ = b.communicate(timeout=300)
    assert a.returncode == 0, out_a
    assert b.returncode == 0, out_b
    ok = _ok_rows(tmp_path / "results" / "results.csv")
    assert ok["row_key"].is_unique
    assert sorted(ok.loc[ok["path"] == "approx", "multiplier"]) == ["exact_s", "mul8s_1KV8", "mul8s_1KV9",
                                                                   "mul8s_1KVA"]
    assert (ok["path"] == "pytorch").sum() == 1 and (ok["path"] == "fakequant").sum() == 1


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_launchers(tmp_path, checkpoints, launcher):
    pytest.importorskip({"joblib": "hydra_plugins.hydra_joblib_launcher",
                         "submitit_local": "hydra_plugins.hydra_submitit_launcher"}[launcher])
    extra = [f"hydra/launcher={launcher}"] + (["hydra.launcher.n_jobs=2"] if launcher == "joblib" else [])
    rc, out = _run(_args(tmp_path, checkpoints, "exact,mul8s_1KV8,mul8u_2V0", *extra))
    assert rc == 0, out
    assert _summary(tmp_path)["status"].tolist() == ["ok", "ok", "ok"]
    ok = _ok_rows(tmp_path / "results" / "results.csv")
    assert ok["row_key"].is_unique and (ok["path"] == "approx").sum() == 3


def test_gpu_lease_one_job_per_gpu(tmp_path):
    """Jobs claim distinct GPUs; a third waits until one is released (threads stand in for processes:
    flock conflicts between separate opens of the file in one process too)."""
    import threading
    import time

    from runner.gpus import gpu_lease

    got, order = [], []
    with gpu_lease(tmp_path, 2) as a, gpu_lease(tmp_path, 2) as b:
        got += [a, b]

        def third():
            with gpu_lease(tmp_path, 2, poll_s=0.01) as c:
                order.append(("third", c))

        t = threading.Thread(target=third)
        t.start()
        time.sleep(0.2)
        order.append(("released", None))
    t.join(5)
    assert sorted(got) == [0, 1]
    assert order[0] == ("released", None) and order[1][0] == "third"
    with gpu_lease(tmp_path, 1) as only:
        assert only == 0
