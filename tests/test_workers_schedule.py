"""How the worker pool (runner.workers) spreads equal jobs over several devices, and the schedule it
reports: every process pre-warms (this one too), so equal jobs go 2 each over 4 processes even with one
of them late; each outcome has its start and end; the pool can start before its tasks are known and be
closed unused; the schedule a run of jobs returns (runner.jobs.run.schedule_of). CPU processes stand in
for GPUs."""
import os
import time
from pathlib import Path

from runner.jobs.run import format_schedule, schedule_of
from runner.workers import Pool, Task, run_tasks
from tests.test_workers import _within

JOB_S = 1.5  # a job; the late process comes 0.5 s after the others, well within one job


def _gate(i: int, marks: str, n: int):
    """A pre-warm: every process waits here until all n have arrived (their start, on this small machine,
    takes seconds each); the last to arrive comes 0.5 s late."""
    gate = Path(marks).with_name("gate")
    gate.mkdir(exist_ok=True)
    (gate / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(gate.iterdir())) < n:
        time.sleep(0.01)
    if sorted(gate.iterdir(), key=lambda p: p.stat().st_mtime_ns)[-1].name == str(os.getpid()):
        time.sleep(0.5)


def _equal_job(i: int, marks: str, n: int):
    Path(marks, f"{i}-{os.getpid()}").touch()
    time.sleep(JOB_S)
    return {"status": "ok"}


def test_eight_equal_jobs_two_per_process_with_one_late(tmp_path):
    """8 equal jobs over 4 processes, one ready 0.5 s after the others: 2 each (this process, which used to
    start on its first job while the workers were still starting, took 3 or more), and their times say so."""
    marks = tmp_path / "marks"
    marks.mkdir()
    tasks = [Task(i, (i, str(marks), 4)) for i in range(8)]
    t0 = time.monotonic()
    outcomes = _within(300, run_tasks, _equal_job, tasks, ["cpu"] * 4, lambda n=1, **info: None, prepare=_gate)
    t1 = time.monotonic()
    assert [o.status for o in outcomes] == ["ok"] * 8, outcomes
    per = {}
    for o in outcomes:
        per.setdefault(o.worker, []).append(o)
    assert sorted(per) == [0, 1, 2, 3] and all(len(v) == 2 for v in per.values()), \
        {w: [o.num for o in v] for w, v in per.items()}
    for o in outcomes:  # each job's start and end: on the host's clock, within the run, one job long
        assert t0 <= o.started < o.ended <= t1 and JOB_S - 0.05 <= o.ended - o.started < JOB_S + 5, o
    for v in per.values():  # a process runs one job at a time
        a, b = sorted(v, key=lambda o: o.started)
        assert a.ended <= b.started + 1e-6


def _quick(i: int, marks: str):
    Path(marks, f"{i}-{os.getpid()}").touch()
    time.sleep(0.05)
    return {"status": "ok"}


def test_pool_started_before_its_tasks(tmp_path):
    """A pool started early: its worker is up (torch imported) before the tasks exist, gets them, and the
    milestones (up <= tasks <= ready) and every outcome's times are there."""
    marks = tmp_path / "marks"
    marks.mkdir()
    pool = Pool(_quick, ["cpu", "cpu"], 4)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "up" not in pool.milestones()[1]:
            time.sleep(0.05)
        assert "up" in pool.milestones()[1], "the worker never came up"
        sent = time.monotonic()
        tasks = [Task(i, (i, str(marks))) for i in range(3)]
        outcomes = _within(120, pool.run, tasks, lambda n=1, **info: None)
    finally:
        pool.close()
    assert [o.status for o in outcomes] == ["ok"] * 3
    assert all(o.started is not None and o.started <= o.ended for o in outcomes)
    m = pool.milestones()
    assert m[1]["up"] <= sent <= m[1]["tasks"] <= m[1]["ready"] and "ready" in m[0]
    assert m[1]["tasks"] - sent < 5.0  # it was waiting for them, not starting


def test_pool_closed_unused_runs_nothing(tmp_path):
    """A pool whose jobs went another way (or a command stopped before its jobs): closed, its workers leave
    at once, whether they had their tasks or not, and no job runs."""
    marks = tmp_path / "marks"
    marks.mkdir()
    for send in (False, True):
        pool = Pool(_quick, ["cpu", "cpu", "cpu"], 2)
        if send:
            pool.send([Task(i, (i, str(marks))) for i in range(2)])
        time.sleep(0.5)
        t0 = time.monotonic()
        pool.close()
        assert time.monotonic() - t0 < 15
        assert not any(p.is_alive() for p in pool.procs.values())
    assert not list(marks.iterdir())


def test_schedule_of():
    timed = [{"job": 3, "device": "cuda:1", "worker": 1, "status": "ok", "started": 107.0, "ended": 112.0},
             {"job": 0, "device": "cuda:0", "worker": 0, "status": "ok", "started": 105.0, "ended": 110.5},
             {"job": 5, "device": "", "worker": None, "status": "failed", "started": None, "ended": None}]
    s = schedule_of(timed, ["cuda:0", "cuda:1"], 100.0, {0: {"ready": 105.0}, 1: {"up": 103.0, "tasks": 104.0,
                                                                                  "ready": 107.0}})
    assert [j["job"] for j in s["jobs"]] == [0, 3, 5]  # by start, the never-run last
    assert s["jobs"][0] == {"job": 0, "device": "cuda:0", "worker": 0, "status": "ok", "started_s": 5.0,
                            "ended_s": 10.5}
    assert s["processes"] == [{"worker": 0, "device": "cuda:0", "ready_s": 5.0, "jobs": [0]},
                              {"worker": 1, "device": "cuda:1", "up_s": 3.0, "tasks_s": 4.0, "ready_s": 7.0,
                               "jobs": [3]}]
    lines = format_schedule(s)
    assert lines[1] == "  cuda:1 (worker 1): 1 jobs; up 3.0, tasks 4.0, ready 7.0: job 3 7.0-12.0"
