"""The claim rule of the worker pool (runner.workers): when a worker takes the next job of a queue this process
works through too. Pure arithmetic on measured job times."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pace:
    """What is measured of one process's jobs so far, in seconds: its first job (which carries the
    one-off warm-up), the mean of its jobs after the first, and how long its current job has run (None:
    no job running)."""
    first_s: float | None = None
    steady_s: float | None = None
    busy_s: float | None = None


def worker_claims(remaining: int, parent_left_s: float, parent_job_s: float, worker_job_s: float) -> bool:
    """Whether a worker takes the next of `remaining` unclaimed jobs: iff
        worker_job_s <= parent_left_s + remaining * parent_job_s,
    i.e. remaining >= (worker_job_s - parent_left_s) / parent_job_s, where parent_left_s is what is left
    of this process's current job and parent_job_s its time per job. The right side is when this process
    alone would have finished the whole queue; the worker's job ends before that, and this process then
    has one job less (parent_left_s + (remaining - 1) * parent_job_s), so a claim never makes the sweep
    end later, by the estimates. A tie claims: a worker as fast as this process takes the last job while
    this process is still busy."""
    return remaining >= 1 and worker_job_s <= parent_left_s + remaining * parent_job_s


def claim_estimates(parent: Pace, worker: Pace, worker_start_s: float) -> tuple[float, float, float] | None:
    """(parent_left_s, parent_job_s, worker_job_s) for worker_claims, from what is measured so far, or None
    (the worker waits) while this process's first job runs and the worker is cold: that job's length is the
    one figure that tells short jobs behind a long one-off warm-up (retraining for one epoch) from long jobs,
    and a guess before it would have a cold worker take jobs in exactly the sweeps where that makes them
    slower. worker.first_s: its first job, or its pre-warm, which stands for it (the one-off costs, paid
    without a job): a pre-warmed worker's first job is then a later one.

    - This process's time per job: the mean of its jobs after the first; until one has ended, how long its
      current job has run (a lower bound: its first job's time includes the one-off warm-up and says
      nothing of the next), with nothing left of it.
    - A cold worker's first job: this process's first job (the same one-off warm-up; its time per job where
      that is longer: the first may have failed at once) plus the worker's start (worker_start_s: from its
      tasks' being sent to its having them; about 0 for a worker started early and waiting), standing in
      for the set-up its first job also does (data, baseline, calibration, references), which this process
      did before the pool began.
    - A worker's later jobs, and every job of a pre-warmed one: the mean of its own after its first (or its
      pre-warm), until then this process's time per job. With that, worker_claims holds whenever a job is
      left (t_p <= t_left + r * t_p): a warm worker takes the next job as soon as it is ready, also while
      this process's first job runs (t_p: that job's time so far)."""
    if parent.first_s is None and worker.first_s is None:
        return None
    busy = parent.busy_s
    if parent.steady_s is not None:
        parent_job = parent.steady_s
        parent_left = 0.0 if busy is None else max(0.0, parent_job - busy)
    else:
        parent_job, parent_left = (busy or 0.0), 0.0
    if worker.first_s is None:
        worker_job = max(parent.first_s, parent_job) + worker_start_s
    else:
        worker_job = worker.steady_s if worker.steady_s is not None else parent_job
    return parent_left, parent_job, worker_job
