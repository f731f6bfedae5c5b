"""The worker pool (runner.workers): every job exactly once over several processes, a failing or dying
job reported while the others finish, no hang; the claim rule in the pool (its arithmetic:
tests/test_workers_claim.py) and the pre-warm; a sweep over two CPU workers gives the in-process rows;
chunks of jobs per launcher task. Workers on the CPU stand in for GPUs here; the 2-GPU tests are marked
cuda and skip with fewer GPUs."""
import os
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from runner.errors import UserError
from runner.jobs.chunks import read_chunk, write_chunks
from runner.workers import Task, resolve_devices, run_tasks
from tests.conftest import has_cpp
from tests.test_sweep import FAST, _run, _summary

# a worker's first job; module state of each worker process (spawned: its own copy)
_ran_here: list[int] = []


def _job(i: int, marks: str, parent: int, fail: int | None = None, die_in_worker: bool = False):
    """Leaves a mark (job, pid); in the parent, each job after its first waits until a worker has marked a
    job, so both serve (a long parent job is what the claim rule gives a worker a job for; the first is
    short: the rule waits for it to end)."""
    pid = os.getpid()
    Path(marks, f"{i}-{pid}").touch()
    if pid == parent and sum(p.name.endswith(f"-{pid}") for p in Path(marks).iterdir()) > 1:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(p.name.split("-")[1] != str(pid) for p in Path(marks).iterdir()):
            time.sleep(0.02)
    elif die_in_worker and not _ran_here:
        os._exit(3)  # a crash that takes the process down (a kernel's segfault, the OOM killer)
    _ran_here.append(i)
    if i == fail:
        raise ValueError(f"job {i} cannot run")
    time.sleep(0.05)
    return {"status": "ok"}


def _within(seconds: float, fn, *args, **kwargs):
    """fn's answer, or a failed test (not a hung suite) when it takes longer."""
    box = {}

    def call():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"no answer within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _tasks(tmp_path: Path, n: int, **kw):
    marks = tmp_path / "marks"
    marks.mkdir()
    return [Task(i, (i, str(marks), os.getpid(), kw.get("fail"), kw.get("die_in_worker", False)))
            for i in range(n)], marks


def _runs(marks: Path) -> dict[int, list[int]]:
    done: dict[int, list[int]] = {}
    for p in marks.iterdir():
        i, pid = map(int, p.name.split("-"))
        done.setdefault(i, []).append(pid)
    return done


def test_every_job_once_over_two_processes(tmp_path):
    tasks, marks = _tasks(tmp_path, 12)
    advanced = []
    outcomes = _within(120, run_tasks, _job, tasks, ["cpu", "cpu"], lambda n=1, **info: advanced.append(n))
    assert [o.num for o in outcomes] == list(range(12))
    assert all(o.status == "ok" for o in outcomes), outcomes
    assert sum(advanced) == 12  # the progress bar counts the workers' jobs too
    runs = _runs(marks)
    assert sorted(runs) == list(range(12)) and all(len(p) == 1 for p in runs.values())  # exactly once
    assert {o.worker for o in outcomes} == {0, 1}
    assert len({pid for p in runs.values() for pid in p}) == 2


def test_failing_job_reported_others_finish(tmp_path):
    tasks, marks = _tasks(tmp_path, 8, fail=5)
    recorded = []
    outcomes = _within(120, run_tasks, _job, tasks, ["cpu", "cpu"], lambda n=1, **info: None,
                       on_failure=lambda task, error: recorded.append((task.num, error)))
    assert [o.status for o in outcomes] == ["ok"] * 5 + ["failed"] + ["ok"] * 2
    assert "ValueError: job 5 cannot run" in outcomes[5].error
    assert [n for n, _ in recorded] == [5]
    assert sorted(_runs(marks)) == list(range(8))


def test_dead_worker_job_failed_no_hang(tmp_path):
    """The worker dies in its first job: that job is failed with the reason, this process runs the rest."""
    tasks, marks = _tasks(tmp_path, 6, die_in_worker=True)
    recorded = []
    outcomes = _within(120, run_tasks, _job, tasks, ["cpu", "cpu"], lambda n=1, **info: None,
                       on_failure=lambda task, error: recorded.append(task.num))
    failed = [o for o in outcomes if o.status == "failed"]
    assert len(failed) == 1 and "exit code 3" in failed[0].error and failed[0].worker == 1, outcomes
    assert recorded == [failed[0].num]
    assert all(o.worker == 0 for o in outcomes if o.status == "ok")


def _start_slowly(marks: str, until: int, ready: str) -> None:
    """Runs in the worker as it unpickles its tasks (part of its start): up once this process has marked
    `until` jobs."""
    import torch  # noqa: F401  (what the worker imports next: loaded here, so it is up at once)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(Path(marks).iterdir())) < until:
        time.sleep(0.01)
    Path(ready).touch()


class _SlowStart:
    """A worker whose start (torch, the CUDA context, its session) outlasts most of a sweep of short jobs."""

    def __init__(self, marks: str, until: int, ready: str):
        self.args = (marks, until, ready)

    def __reduce__(self):
        return _start_slowly, self.args


def _short_job(i: int, marks: str, until: int, ready: str, slow_start=None):
    """A short job; job `until` (in whichever process) waits for the worker to be up, so jobs are left
    when it is."""
    Path(marks, f"{i}-{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while i == until and time.monotonic() < deadline and not Path(ready).exists():
        time.sleep(0.01)
    time.sleep(0.05)
    return {"status": "ok"}


def test_slow_worker_start_leaves_every_short_job_here(tmp_path, monkeypatch):
    """The worker is up with 10 jobs of 0.05 s left; its first job would cost this process's first plus
    its start, far more than the 0.5 s left, so it takes none (taking jobs as soon as it was up, it took
    some) and leaves by itself once the queue is empty."""
    import runner.workers as workers

    marks, ready, n, until = tmp_path / "marks", tmp_path / "worker-up", 30, 20
    marks.mkdir()
    gate = _SlowStart(str(marks), until, str(ready))
    tasks = [Task(i, (i, str(marks), until, str(ready), gate if i == 0 else None)) for i in range(n)]
    exits = []
    stop = workers._stop

    def recording_stop(procs, timeout_s):
        stop(procs, timeout_s)
        exits.extend((w, p.exitcode) for w, p in procs.items())

    monkeypatch.setattr(workers, "_stop", recording_stop)
    outcomes = _within(120, run_tasks, _short_job, tasks, ["cpu", "cpu"], lambda n=1, **info: None)
    assert ready.exists()  # the worker was up while jobs were left
    assert [o.status for o in outcomes] == ["ok"] * n and {o.worker for o in outcomes} == {0}, outcomes
    assert {pid for pids in _runs(marks).values() for pid in pids} == {os.getpid()}
    assert exits and all(code == 0 for _, code in exits), exits  # left by itself, not terminated


def _marked_job(i: int, marks: str, parent: int, how: str = ""):
    """A short job; this process's first waits (up to 30 s) for a worker to mark a job (how: "") or to have
    tried its pre-warm (how: the pre-warm's failure)."""
    Path(marks, f"{i}-{os.getpid()}").touch()
    deadline = time.monotonic() + 30

    def waits() -> bool:
        if how:
            return not Path(marks).with_name("prewarm").exists()
        return all(p.name.endswith(f"-{parent}") for p in Path(marks).iterdir())

    while i == 0 and os.getpid() == parent and time.monotonic() < deadline and waits():
        time.sleep(0.02)
    time.sleep(0.05)
    return {"status": "ok"}


def _prewarm(i: int, marks: str, parent: int, how: str = ""):
    """A pre-warm on task i's args: marks it beside the jobs' marks; how: raise, or die (a worker's process;
    this one's death would be the command's)."""
    Path(marks).with_name("prewarm").mkdir(exist_ok=True)
    Path(marks).with_name("prewarm").joinpath(f"{i}-{os.getpid()}").touch()
    if how == "raise":
        raise RuntimeError("no data here")
    if how == "die" and os.getpid() != parent:
        os._exit(5)


def test_pre_warmed_worker_claims_during_the_first_job(tmp_path):
    """A pre-warmed worker takes a job while this process's first job still runs (a cold one waits for it
    to end: the first job here would run into its 30 s limit)."""
    tasks, marks = _tasks_of(tmp_path, 6, "")
    t0 = time.monotonic()
    outcomes = _within(120, run_tasks, _marked_job, tasks, ["cpu", "cpu"], lambda n=1, **info: None,
                       prepare=_prewarm)
    assert [o.status for o in outcomes] == ["ok"] * 6 and outcomes[0].worker == 0, outcomes
    assert 1 in {o.worker for o in outcomes} and time.monotonic() - t0 < 25  # job 0 did not wait out its limit
    # once in each process (this one too, before its first job), on the args of a job left then
    pids = sorted(pid for pids in _runs(tmp_path / "prewarm").values() for pid in pids)
    assert len(pids) == 2 and os.getpid() in pids
    runs = _runs(marks)
    assert sorted(runs) == list(range(6)) and all(len(p) == 1 for p in runs.values())


def _tasks_of(tmp_path: Path, n: int, how: str):
    marks = tmp_path / "marks"
    marks.mkdir()
    return [Task(i, (i, str(marks), os.getpid(), how)) for i in range(n)], marks


@pytest.mark.parametrize("how", ["raise", "die"])
def test_failed_pre_warm_leaves_every_job_done(tmp_path, how):
    """A pre-warm that raises leaves the worker cold (it may still take jobs by the old estimate); one that
    takes the worker down loses no job: this process does them all."""
    tasks, marks = _tasks_of(tmp_path, 8, how)
    t0 = time.monotonic()
    outcomes = _within(120, run_tasks, _marked_job, tasks, ["cpu", "cpu"], lambda n=1, **info: None,
                       prepare=_prewarm)
    assert [o.status for o in outcomes] == ["ok"] * 8, outcomes
    runs = _runs(marks)
    assert sorted(runs) == list(range(8)) and all(len(p) == 1 for p in runs.values())
    assert time.monotonic() - t0 < 25  # the pre-warm ran (and failed) while job 0 waited for it
    if how == "die":
        assert {o.worker for o in outcomes} == {0}


class _SlowToRead:
    """Unpickles slowly, as a spawned worker reads its tasks while it imports torch on the way."""

    def __reduce__(self):
        return time.sleep, (3.0,)


def _started_at(i: int, marks: str, *payload):
    Path(marks, f"{i}-{os.getpid()}-{time.monotonic()}").touch()
    return {"status": "ok"}


def test_a_slow_worker_start_does_not_hold_this_process(tmp_path):
    """Tasks over the pipe's buffer that a worker reads slowly: this process starts its first job at once,
    not after the worker has read them (its start used to wait on that write)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    payload = (_SlowToRead(), b"x" * 1_000_000)
    tasks = [Task(i, (i, str(marks), *payload)) for i in range(3)]
    t0 = time.monotonic()
    outcomes = _within(120, run_tasks, _started_at, tasks, ["cpu", "cpu"], lambda n=1, **info: None)
    assert [o.status for o in outcomes] == ["ok"] * 3 and {o.worker for o in outcomes} == {0}, outcomes
    first = min(float(p.name.split("-", 2)[2]) for p in marks.iterdir() if p.name.startswith("0-"))
    assert first - t0 < 2.0, f"job 0 started {first - t0:.1f} s after the pool"


def test_pre_warm_builds_each_setup_once(tmp_path):
    """A process pre-warms the next job's setup and then one job of each other setup left, once each."""
    tasks, marks = _tasks_of(tmp_path, 6, "")
    tasks = [Task(t.num, t.args, setup="ab"[t.num >= 3]) for t in tasks]
    outcomes = _within(120, run_tasks, _marked_job, tasks, ["cpu", "cpu"], lambda n=1, **info: None,
                       prepare=_prewarm)
    assert [o.status for o in outcomes] == ["ok"] * 6, outcomes
    by_pid: dict[int, list[int]] = {}  # each process (this one and the worker) built each setup once
    for i, pids in _runs(tmp_path / "prewarm").items():
        for pid in pids:
            by_pid.setdefault(pid, []).append(i)
    assert len(by_pid) == 2 and all(len(v) == 2 and sum(i >= 3 for i in v) == 1 for v in by_pid.values()), by_pid


def _waits_for_a_worker(i: int, marks: str, parent: int, idx: str):
    """This process's jobs wait (up to 60 s) for a worker's pre-warm mark, so the worker is up and pre-warms."""
    deadline = time.monotonic() + 60
    while os.getpid() == parent and time.monotonic() < deadline and \
            not any(p.name.split("-")[1] != str(parent) for p in Path(marks).iterdir()):
        time.sleep(0.02)
    return {"status": "ok"}


def _decodes_idx(i: int, marks: str, parent: int, idx: str):
    """A pre-warm that loads an IDX file: marks whether this process had it decoded already or read it."""
    from runner.data import mnist

    reads = []
    read = mnist.read_idx
    mnist.read_idx = lambda p: reads.append(p) or read(p)
    try:
        mnist.decoded_idx(Path(idx))
    finally:
        mnist.read_idx = read
    Path(marks, f"{'read' if reads else 'adopted'}-{os.getpid()}").touch()


def test_workers_get_the_idx_files_this_process_decoded(tmp_path):
    """A worker's pre-warm finds the data files this process decoded before the pool ran (runner.workers.
    _handover): it does not decompress them again."""
    from runner.data import mnist
    from tests.data.test_mnist import _write_set

    _write_set(tmp_path, gz=True)
    idx = tmp_path / "train-images-idx3-ubyte.gz"
    mnist.decoded_idx(idx)
    marks = tmp_path / "marks"
    marks.mkdir()
    tasks = [Task(i, (i, str(marks), os.getpid(), str(idx))) for i in range(2)]
    outcomes = _within(120, run_tasks, _waits_for_a_worker, tasks, ["cpu", "cpu"], lambda n=1, **info: None,
                       prepare=_decodes_idx)
    assert [o.status for o in outcomes] == ["ok", "ok"], outcomes
    worker_marks = [p.name for p in marks.iterdir() if p.name.split("-")[1] != str(os.getpid())]
    assert worker_marks and all(m.startswith("adopted-") for m in worker_marks), sorted(worker_marks)


def test_resolve_devices(monkeypatch):
    import runner.workers as workers

    monkeypatch.setattr(workers, "_cuda_count", lambda: 2)
    assert resolve_devices("auto", uses_cuda=True) == ["cuda:0", "cuda:1"]
    assert resolve_devices("auto", uses_cuda=False) == ["cpu"]
    assert resolve_devices(["cuda:1", "cuda"], uses_cuda=True) == ["cuda:1", "cuda:0"]
    assert resolve_devices("cpu,cpu", uses_cuda=False) == ["cpu", "cpu"]
    with pytest.raises(UserError, match="torch sees 2 GPU"):
        resolve_devices(["cuda:2"], uses_cuda=True)
    with pytest.raises(UserError, match="not a device"):
        resolve_devices(["gpu1"], uses_cuda=True)
    monkeypatch.setattr(workers, "_cuda_count", lambda: 1)
    assert resolve_devices("auto", uses_cuda=True) == ["cuda:0"]  # one GPU: in-process, no worker


def test_chunks_cover_every_job_once(tmp_path):
    jobs = [[f"sweep.multiplier=m{i}"] for i in range(5)]
    assert write_chunks(tmp_path, jobs, 2) == 3
    got = [j for c in range(3) for j in read_chunk(tmp_path, c)]
    assert [j["num"] for j in got] == list(range(5)) and [j["overrides"] for j in got] == jobs
    with pytest.raises(UserError, match="3 chunk"):
        read_chunk(tmp_path, 3)
    with pytest.raises(UserError, match="positive"):
        write_chunks(tmp_path, jobs, 0)


# ---------------------------------------------------------------- end to end: `approx-run sweep`

needs_cpp = pytest.mark.skipif(not has_cpp(), reason="needs the C++ extension (backend=cpp)")
TABLES = "mul8s_1KV8,mul8s_1KV9,mul8s_1KVA,mul8u_2V0"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from runner.train import load_or_train
    from tests.conftest import compose

    root = tmp_path_factory.mktemp("pool_ckpt")
    load_or_train(compose("sweep", [*FAST, f"paths.checkpoints={root}", f"paths.results={root / 'r'}"]))
    return root


def _sweep(tmp_path: Path, checkpoints: Path, tables: str, *extra: str):
    return _run(["sweep", f"sweep.multipliers={tables}", "backend=cpp", *FAST, f"paths.results={tmp_path / 'results'}",
                 f"paths.checkpoints={checkpoints}", *extra], timeout=300)


def _approx_rows(tmp_path: Path) -> pd.DataFrame:
    df = pd.read_csv(tmp_path / "results" / "results.csv")
    return df[(df["path"] == "approx")].sort_values("multiplier").reset_index(drop=True)


@needs_cpp
def test_sweep_on_two_cpu_workers_gives_in_process_rows(tmp_path, checkpoints):
    bad = tmp_path / "broken.txt"
    bad.write_text("not a table\n")
    tables = f"{TABLES},{bad}"
    rc, out = _sweep(tmp_path / "one", checkpoints, tables)
    assert rc == 1, out  # the broken table fails its job
    rc, out = _sweep(tmp_path / "two", checkpoints, tables, "sweep.devices=[cpu,cpu]")
    assert rc == 1, out
    one, two = _approx_rows(tmp_path / "one"), _approx_rows(tmp_path / "two")
    cols = ["multiplier", "status", "row_key", "correct", "accuracy", "agreement_fakequant"]
    pd.testing.assert_frame_equal(one[cols], two[cols])
    assert two.loc[two["status"] == "ok", "row_key"].is_unique and (two["status"] == "ok").sum() == 4
    summary = _summary(tmp_path / "two")
    assert summary["status"].tolist() == ["ok"] * 4 + ["failed"]
    assert summary["error"].iloc[4] and "broken.txt" in summary["multiplier"].iloc[4]
    # the schedule: every job on one of the two processes, its start and end in seconds since the sweep began
    import json

    sched = json.loads(next((tmp_path / "two" / "results" / "sweep").glob("*/schedule.json")).read_text())
    assert sorted(j["job"] for j in sched["jobs"]) == list(range(5))
    assert all(j["device"] == "cpu" and j["worker"] in (0, 1) and 0 < j["started_s"] <= j["ended_s"]
               for j in sched["jobs"]), sched
    assert [p["worker"] for p in sched["processes"]] == [0, 1] and sched["processes"][0]["ready_s"] > 0
    assert sum(len(p["jobs"]) for p in sched["processes"]) == 5
    assert "sweep schedule (seconds since the sweep began" in out


@needs_cpp
def test_prepare_fills_the_session_writes_nothing_changes_no_row(tmp_path, checkpoints, monkeypatch):
    """compare.prepare (a worker's pre-warm) with retraining on: a few throwaway training steps, nothing
    written (no row, no retrained checkpoint), the references' predictions kept; the run after it gives
    the rows of a run without it."""
    from runner import compare, finetune, session
    from runner.train_step import GRAPH_WARMUP
    from tests.conftest import compose

    trained = []
    train_epochs = finetune.train_epochs
    monkeypatch.setattr(finetune, "train_epochs", lambda model, data, *a, **kw: (
        trained.append(len(data.train_x)), train_epochs(model, data, *a, **kw))[1])

    def cfg(name):
        return compose("compare", [*FAST, "backend=cpp", "multiplier=mul8s_1KV8", "finetune.epochs=1",
                                   "finetune.batch_size=64", "finetune.force=true",
                                   f"paths.results={tmp_path / name}", f"paths.checkpoints={checkpoints}"])

    def run(name):
        (tmp_path / name / "run").mkdir(parents=True)
        compare.run(cfg(name), tmp_path / name / "run", quiet=True)
        rows = pd.read_csv(tmp_path / name / "results.csv").sort_values("path").reset_index(drop=True)
        return rows[["path", "correct", "accuracy", "agreement_fakequant", "row_key"]]

    session.reset()
    cold = run("cold")
    session.reset()
    before = sorted(checkpoints.rglob("*.pt"))
    trained.clear()
    assert compare.prepare(cfg("warm"))["status"] == "prepared"
    assert trained == [64 * (GRAPH_WARMUP + 2)]
    assert not (tmp_path / "warm").exists() and sorted(checkpoints.rglob("*.pt")) == before
    keys = compare.plan_run(cfg("warm")).row_keys
    assert session.get().predictions(keys["pytorch"]) is not None
    assert session.get().predictions(keys["fakequant"]) is not None
    warm = run("warm")
    assert set(warm["path"]) == {"pytorch", "fakequant", "approx", "approx_finetuned"}
    pd.testing.assert_frame_equal(cold, warm)
    session.reset()


@needs_cpp
def test_bad_devices_is_a_user_error(tmp_path, checkpoints):
    rc, out = _sweep(tmp_path, checkpoints, "mul8s_1KV8", "sweep.devices=[cuda:7]")
    assert rc == 2, out
    assert "sweep.devices" in out and "Traceback" not in out


@needs_cpp
@pytest.mark.parametrize("value", ["-1", "2.5"])
def test_bad_chunk_size_is_a_user_error_before_any_job(tmp_path, checkpoints, value):
    rc, out = _sweep(tmp_path, checkpoints, "mul8s_1KV8", "hydra/launcher=joblib", f"sweep.chunk_size={value}")
    assert rc == 2, out
    assert "sweep.chunk_size" in out and "Traceback" not in out
    assert not list(tmp_path.rglob("job.json"))  # no job ran


@needs_cpp
@pytest.mark.slow
def test_joblib_sweep_returns_promptly(tmp_path, checkpoints):
    """The joblib launcher leaves idle workers for 300 s; a command that imported torch exits with os._exit
    after the exit hooks, and multiprocessing's waited for them."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    import subprocess
    import sys

    from tests.conftest import REPO

    script = ("import sys; from runner.cli import main; "
              "sys.argv = ['approx-run', *sys.argv[1:]]; sys.exit(main())")
    args = ["sweep", "sweep.multipliers=mul8s_1KV8,mul8s_1KV9", "backend=cpp", *FAST,
            f"paths.results={tmp_path / 'results'}", f"paths.checkpoints={checkpoints}",
            "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=200, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sweep: 2 ok" in p.stdout
    assert wall < 120, f"returned after {wall:.0f} s (the joblib workers' idle timeout is 300 s)"


@needs_cpp
@pytest.mark.slow
def test_submitit_local_chunks(tmp_path, checkpoints):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    rc, out = _sweep(tmp_path, checkpoints, TABLES, "hydra/launcher=submitit_local", "sweep.chunk_size=2")
    assert rc == 0, out
    rows = _approx_rows(tmp_path)
    assert sorted(rows["multiplier"]) == sorted(TABLES.split(",")) and rows["row_key"].is_unique
    sweep_dir = sorted((tmp_path / "results" / "sweep").iterdir())[-1]
    tasks = [d for d in (sweep_dir / ".submitit").iterdir() if d.name.isdigit()]  # one folder per task (job id)
    assert len(tasks) == 2  # two tasks, two jobs each
    assert sorted(p.name for p in sweep_dir.glob("chunk[0-9]*")) == ["chunk0", "chunk1"]
    assert _summary(tmp_path)["status"].tolist() == ["ok"] * 4
    # resumed: the same command skips every job
    rc, out = _sweep(tmp_path, checkpoints, TABLES, "hydra/launcher=submitit_local", "sweep.chunk_size=2")
    assert rc == 0, out
    assert _summary(tmp_path)["status"].tolist() == ["skipped"] * 4


def test_rows_name_the_hosts_gpu(monkeypatch):
    """A worker sees its GPU as cuda:0; its rows and run.json must name the card the host knows."""
    import torch

    from runner.provenance import host_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert host_device(torch.device("cuda:1")) == "cuda:5"
    assert host_device(torch.device("cuda")) == "cuda:3"
    assert host_device(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2a")  # UUIDs: keep torch's name
    assert host_device(torch.device("cuda:0")) == "cuda:0"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert host_device(torch.device("cuda:1")) == "cuda:1"


@pytest.mark.cuda
@needs_cpp
def test_two_gpus_rows_as_one(tmp_path, checkpoints):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    tables = "mul8s_1KV8,mul8s_1KV9,mul8s_1KVA,mul8u_2V0,mul8u_17C8,mul8u_T83"
    rc, out = _run(["sweep", f"sweep.multipliers={tables}", "backend=cuda", *FAST,
                    f"paths.results={tmp_path / 'one' / 'results'}", f"paths.checkpoints={checkpoints}",
                    "sweep.devices=[cuda:0]"], timeout=300)
    assert rc == 0, out
    rc, out = _run(["sweep", f"sweep.multipliers={tables}", "backend=cuda", *FAST,
                    f"paths.results={tmp_path / 'two' / 'results'}", f"paths.checkpoints={checkpoints}",
                    "sweep.devices=auto"], timeout=300)
    assert rc == 0, out
    cols = ["multiplier", "status", "row_key", "correct", "accuracy"]
    pd.testing.assert_frame_equal(_approx_rows(tmp_path / "one")[cols], _approx_rows(tmp_path / "two")[cols])
    # each process names its own card (a worker takes jobs only once pre-warmed, often after these short
    # ones are all done: which card ran them is the claim rule's call)
    assert set(_approx_rows(tmp_path / "two")["device"]) <= {"cuda:0", "cuda:1"}


@needs_cpp
def test_sensitivity_on_two_cpu_workers_gives_in_process_table(tmp_path, checkpoints):
    tables = []
    for name, extra in (("one", []), ("two", ["sensitivity.devices=[cpu,cpu]"])):
        rc, out = _run(["sensitivity", "sensitivity.multipliers=mul8s_1KV8,mul8s_1L2N", "backend=cpp", *FAST,
                        "sensitivity.plot=false", f"paths.results={tmp_path / name}",
                        f"paths.checkpoints={checkpoints}", *extra], timeout=300)
        assert rc == 0, out
        tables.append(pd.read_csv(next((tmp_path / name / "sensitivity").glob("*/sensitivity.csv"))))
    cols = ["layer", "multiplier", "status", "accuracy", "fakequant_accuracy", "row_key"]
    pd.testing.assert_frame_equal(tables[0][cols], tables[1][cols])
    assert (tables[1]["status"] == "ok").all() and len(tables[1]) == 10
