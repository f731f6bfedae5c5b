"""The claim rule of the worker pool (runner.jobs.claims.worker_claims, claim_estimates): a worker takes a job
only where that ends the queue sooner, checked as pure functions and on a simulated two-process clock
(the pool itself: tests/test_workers.py)."""
import pytest

from runner.jobs.claims import Pace, claim_estimates, worker_claims


def test_claim_rule_threshold():
    # 4 jobs left, this process's jobs take 2 s and 1 s is left of its current one: alone it ends in 9 s
    assert worker_claims(4, 1.0, 2.0, 8.9) and worker_claims(4, 1.0, 2.0, 9.0)
    assert not worker_claims(4, 1.0, 2.0, 9.1)
    assert not worker_claims(0, 5.0, 2.0, 0.1)  # nothing left to take
    # the last job: a worker as fast as this process takes it while this process is still busy, a slower
    # one only if this process has more than the difference left of its job
    assert worker_claims(1, 0.5, 2.0, 2.0)
    assert worker_claims(1, 1.5, 2.0, 3.0) and not worker_claims(1, 0.5, 2.0, 3.0)


def test_claim_estimates():
    # this process's first job still running: nothing known, the worker waits
    assert claim_estimates(Pace(busy_s=30.0), Pace(), 4.0) is None
    # its first job took 6 s, its second has run 1 s: per job at least 1 s; the worker's first job is
    # this process's first plus the worker's own start
    assert claim_estimates(Pace(6.0, None, 1.0), Pace(), 4.0) == (0.0, 1.0, 10.0)
    # later jobs measured: 2 s each, 0.5 s of the current one done
    assert claim_estimates(Pace(6.0, 2.0, 0.5), Pace(), 4.0) == (1.5, 2.0, 10.0)
    assert claim_estimates(Pace(6.0, 2.0, None), Pace(), 4.0) == (0.0, 2.0, 10.0)  # between two jobs
    assert claim_estimates(Pace(6.0, 2.0, 3.0), Pace(), 4.0) == (0.0, 2.0, 10.0)   # overdue: nothing left
    # a first job that failed at once carried no warm-up: the longer time per job stands in for it
    assert claim_estimates(Pace(0.1, 2.0, 0.5), Pace(), 4.0) == (1.5, 2.0, 6.0)
    assert claim_estimates(Pace(0.1, None, 3.0), Pace(), 4.0) == (0.0, 3.0, 7.0)
    # a worker past its first job: as fast as this process until its own later jobs are measured
    assert claim_estimates(Pace(6.0, 2.0, 0.5), Pace(9.0, None, None), 4.0) == (1.5, 2.0, 2.0)
    assert claim_estimates(Pace(6.0, 2.0, 0.5), Pace(9.0, 3.0, None), 4.0) == (1.5, 2.0, 3.0)


def test_claim_estimates_pre_warmed():
    """A pre-warmed worker (its pre-warm, 7 s, stands for its first job) is costed as this process's time per
    job: it need not wait for this process's first job, and the rule then holds whenever a job is left."""
    warm = Pace(7.0, None, None)
    assert claim_estimates(Pace(busy_s=3.0), warm, 4.0) == (0.0, 3.0, 3.0)  # first job running: its time so far
    assert claim_estimates(Pace(6.0, 2.0, 0.5), warm, 4.0) == (1.5, 2.0, 2.0)
    assert claim_estimates(Pace(6.0, None, 1.0), warm, 4.0) == (0.0, 1.0, 1.0)
    for parent in (Pace(busy_s=0.0), Pace(busy_s=3.0), Pace(6.0, 2.0, 0.5), Pace(6.0, 2.0, 3.0)):
        assert worker_claims(1, *claim_estimates(parent, warm, 4.0))
        assert not worker_claims(0, *claim_estimates(parent, warm, 4.0))
    # its own jobs measured slower (4 s): back to the rule's threshold, also during this process's first job
    assert claim_estimates(Pace(busy_s=3.0), Pace(7.0, 4.0, None), 4.0) == (0.0, 3.0, 4.0)
    assert not worker_claims(1, 0.0, 3.0, 4.0) and worker_claims(2, 0.0, 3.0, 4.0)


def _simulate(n: int, parent_first: float, parent_job: float, worker_start: float, worker_first: float,
              worker_job: float, dt: float = 0.01, prewarm: float | None = None) -> tuple[list[int], float]:
    """This process and one worker over n jobs on a clock of dt steps, the worker asking the rule each step
    it is idle (as it polls): (the jobs the worker took, when the last job ended). prewarm: the seconds of a
    worker's pre-warm, ended at worker_start (its time then stands for its first job, as in _serve)."""
    taken, done = [], {"parent": [], "worker": [] if prewarm is None else [prewarm]}
    busy = {"parent": (0, 0.0, parent_first)}  # who -> (job, start, end)
    nxt, t, ends = 1, 0.0, []

    def pace(who: str, now: float) -> Pace:
        times = done[who]
        job = busy.get(who)
        return Pace(times[0] if times else None, sum(times[1:]) / (len(times) - 1) if len(times) > 1 else None,
                    now - job[1] if job else None)

    while busy or nxt < n:
        for who, (job, start, end) in list(busy.items()):
            if end <= t + 1e-9:
                done[who].append(end - start)
                ends.append(end)
                del busy[who]
                if who == "parent" and nxt < n:  # this process takes the next job at once
                    busy["parent"] = (nxt, end, end + parent_job)
                    nxt += 1
        if "worker" not in busy and t >= worker_start and nxt < n:
            estimates = claim_estimates(pace("parent", t), pace("worker", t), worker_start)
            if estimates is not None and worker_claims(n - nxt, *estimates):
                busy["worker"] = (nxt, t, t + (worker_job if taken else worker_first))
                taken.append(nxt)
                nxt += 1
        t += dt
    return taken, max(ends)


@pytest.mark.parametrize("worker_start", [3.5, 7.5])
def test_rule_short_jobs_behind_a_warm_up_stay_in_this_process(worker_start):
    """Four 1-epoch retrainings: 6.8 s first job (its warm-up), 1.3 s after; a worker's first job 8.5 s.
    Taking any of them would end the sweep later than this process alone does (10.7 s)."""
    taken, end = _simulate(4, 6.8, 1.3, worker_start, 8.5, 1.3)
    assert taken == [] and end == pytest.approx(6.8 + 3 * 1.3)
    taken, end = _simulate(19, 0.3, 0.1, worker_start, 2.0, 0.1)  # 19 short evaluations
    assert taken == []


def test_rule_long_jobs_shared_about_half():
    alone = 12.0 + 19 * 10.0
    taken, end = _simulate(20, 12.0, 10.0, 4.0, 14.0, 10.0)
    assert 8 <= len(taken) <= 10 and end < 0.6 * alone


def test_rule_tail():
    """Five 5 s jobs, a worker up at 2 s whose first job takes 7 s. It waits for this process's first job
    (5 s), then takes job 2 once this process's second job has run 7/3 s (3 jobs left at least that long:
    7.3 s -> 14.3 s); warm, it takes the last job (4) while this process still has 0.7 s of job 3: done at
    19.3 s, where this process would have ended it at 20 s. With three jobs it takes none: job 1 is this
    process's at once and one job left after it cannot be shown to last the 7 s."""
    taken, end = _simulate(5, 5.0, 5.0, 2.0, 7.0, 5.0)
    assert taken == [2, 4] and end == pytest.approx(5 + 7 / 3 + 7 + 5, abs=0.05)
    taken, end = _simulate(3, 5.0, 5.0, 2.0, 7.0, 5.0)
    assert taken == [] and end == pytest.approx(15.0)


@pytest.mark.parametrize("n", [2, 3, 4, 6, 10, 19])
@pytest.mark.parametrize("first, job", [(6.8, 1.3), (11.0, 5.4), (2.0, 2.0), (0.3, 0.1), (30.0, 25.0)])
@pytest.mark.parametrize("worker_start", [1.0, 4.0, 9.0])
def test_rule_never_slower_than_this_process_alone(n, first, job, worker_start):
    """Where the estimates hold (the worker's first job costs at most this process's first plus its own
    start, its later jobs as this process's), no claim ends the sweep later."""
    alone = first + (n - 1) * job
    for set_up in (0.0, worker_start):  # what the worker's first job adds to this process's first
        _, end = _simulate(n, first, job, worker_start, first + set_up, job)
        assert end <= alone + 0.02


@pytest.mark.parametrize("n, first, job, ready, took, end", [
    (4, 6.8, 1.3, 11.5, [], 10.7),              # 1 epoch: warm after this process is done, it takes none
    (4, 6.8, 1.3, 9.0, [3], 10.3),               # warm with the last job left: ends it first (same cost)
    (4, 10.5, 5.5, 11.0, [2], 21.5),             # 5 epochs: 27.0 s alone
    (4, 10.5, 5.5, 15.0, [2], 21.5),
    (8, 10.5, 5.5, 6.0, [1, 3, 5, 7], 28.1)])    # warm in this process's first job: takes one at once (49 s alone)
def test_rule_pre_warmed_worker(n, first, job, ready, took, end):
    """A pre-warmed worker whose jobs all cost this process's later ones (the pre-warm's aim), up `ready` s
    into the jobs (its start and 7 s of pre-warm), with the timings of the benchmarks."""
    taken, last = _simulate(n, first, job, ready, job, job, prewarm=7.0)
    assert taken == took and last == pytest.approx(end, abs=0.05)
    assert last <= first + (n - 1) * job + 0.02


@pytest.mark.parametrize("n", [2, 4, 19])
@pytest.mark.parametrize("ready", [0.5, 5.0, 12.0])
def test_rule_pre_warmed_never_slower(n, ready):
    for first, job in ((6.8, 1.3), (10.5, 5.5), (0.3, 0.1)):
        _, last = _simulate(n, first, job, ready, job, job, prewarm=3.0)
        assert last <= first + (n - 1) * job + 0.02
