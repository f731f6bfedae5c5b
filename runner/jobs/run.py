"""Running planned jobs: one job (a compare run that leaves job.json for the sweep summary), and a list of
jobs one after another in this process, sharing its evaluation session (runner.session): the model, data,
calibration and reference predictions are set up once for all of them. This is what Hydra's basic launcher
would do, without composing every job again; other launchers call run_job in their own processes."""
from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig

from runner.errors import UserError
from runner.jobs.hydra_app import resolve_in_place
from runner.jobs.plan import Job, Plan, with_multiplier


def plan_or_reason(cfg: DictConfig) -> tuple[Plan | None, str]:
    """(the job's plan, ""), or (None, the reason it cannot run): the job then records itself failed."""
    from runner import compare

    try:
        return compare.plan_run(cfg), ""
    except UserError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001  (one broken job must not stop the others being planned)
        return None, f"{type(exc).__name__}: {exc}"


def plan_all(jobs: list[Job]) -> list[Job]:
    """Each job with its plan, or the reason it has none. A job's config is final once planned, so it is
    resolved here (resolve_in_place: each later read is a plain value), if its composer has not done so."""
    for job in jobs:
        resolve_in_place(job.cfg)
        job.plan, job.plan_error = plan_or_reason(job.cfg)
    return jobs


def _limit_threads() -> None:
    """Parallel joblib jobs share the cores instead of each taking all of them."""
    try:
        from hydra.core.hydra_config import HydraConfig

        launcher = HydraConfig.get().launcher
    except (ValueError, ImportError):
        return
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return
    import torch

    n_jobs = int(launcher.get("n_jobs") or -1)
    cores = os.cpu_count() or 1
    n_jobs = cores if n_jobs < 1 else n_jobs
    torch.set_num_threads(max(1, cores // n_jobs))


def run_job(cfg: DictConfig, out_dir: Path, overrides: list[str] | None = None, quiet: bool = False,
            plan: Plan | None = None) -> dict:
    """One sweep job: a compare run; job.json records what happened for the sweep summary. overrides: None
    when a Hydra launcher runs it (they are then Hydra's task overrides). quiet: no per-job table (the
    in-process loop shows progress, the summary the numbers)."""
    from runner import compare
    from runner.provenance import atomic_write_json

    t0 = time.time()
    if overrides is None and cfg.get("sweep", {}).get("chunk") is not None:  # a launcher task of many jobs
        from runner import workers

        _limit_threads()
        return workers.run_chunk(int(cfg.sweep.chunk), Path(out_dir).parent, run_jobs)
    if overrides is None:  # launched by Hydra (a parallel or cluster launcher)
        from hydra.core.hydra_config import HydraConfig

        _limit_threads()
        try:
            overrides = list(HydraConfig.get().overrides.task)
        except ValueError:
            overrides = []
        cfg = with_multiplier(cfg)  # Hydra composed it; in-process jobs come with their multiplier set
    result = compare.run(cfg, out_dir, quiet=quiet, plan=plan)
    atomic_write_json(Path(out_dir) / "job.json", {
        "status": result.get("status"), "error": result.get("error", ""), "overrides": overrides,
        "elapsed_s": round(time.time() - t0, 3)})
    return result


def run_jobs(jobs: list[Job], title: str, devices: list[str] | None = None, shard: bool = True) -> None:
    """The jobs in this process, each in its own run dir (config.yaml, job.json); with several devices,
    spread over a worker per device (runner.workers), this process serving the first; or, when the jobs
    with work to do are fewer than the devices (shard, sharded_jobs), each of them over its share of the
    devices at once, its images sharded (run_sharded)."""
    from runner import workers
    from runner.console import console, fmt_seconds, progress_bar
    from runner.provenance import write_config_yaml

    shares = sharded_jobs(jobs, devices) if shard else {}
    pooled = not shares and devices is not None and len(devices) > 1 and len(jobs) > 1
    tasks = []
    console.print(title, highlight=False)  # the count of evaluations, before the first starts
    t0 = time.perf_counter()
    with progress_bar(title, total=len(jobs)) as advance:
        for i, job in enumerate(jobs):
            job.out_dir.mkdir(parents=True, exist_ok=True)
            write_config_yaml(job.out_dir / "config.yaml", job.cfg)
            if job.num in shares:  # below, all at once
                continue
            if pooled:
                # jobs sharing fake-quant rows share calibration and references: one set-up to pre-warm
                setup = job.plan.row_keys["fakequant"] if job.plan else ""
                tasks.append(workers.Task(job.num, (job.cfg, job.out_dir, job.overrides, True, job.plan), setup))
                continue
            result = run_job(job.cfg, job.out_dir, overrides=job.overrides, quiet=True, plan=job.plan)
            if i == 0 and len(jobs) > 1 and not shares and result.get("status") != "skipped":
                # the first job also loads data, calibrates and runs the references: an upper bound per job
                first = time.perf_counter() - t0
                console.print(f"first evaluation (with the set-up) {fmt_seconds(first)}: the {len(jobs)} take at "
                              f"most about {fmt_seconds(first * len(jobs))}", highlight=False)
            advance(1, **(job.label or {"job": job.num, "status": result.get("status")}))
        if shares:
            run_sharded([job for job in jobs if job.num in shares], shares, advance)
        if tasks:
            workers.run_tasks(run_job, tasks, devices, advance, on_failure=record_failure, prepare=prepare_job)


def prepare_job(cfg: DictConfig, out_dir: Path, overrides: list[str] | None = None, quiet: bool = True,
                plan: Plan | None = None) -> dict:
    """A pool worker's pre-warm, on a job's arguments (run_job's): what the job would set up, left in this
    process's session for the jobs it takes (runner.compare.prepare); nothing is written."""
    from runner import compare

    return compare.prepare(cfg, plan=plan)


def record_failure(task, error: str) -> None:
    """A pooled job that ended without recording itself (its worker died): its job.json says so for the
    sweep summary."""
    from runner.provenance import atomic_write_json

    _, out_dir, overrides, _, _ = task.args
    atomic_write_json(Path(out_dir) / "job.json", {"status": "failed", "error": error, "overrides": overrides,
                                                   "elapsed_s": None})


# ---------------------------------------------------------------- fewer jobs than devices: each one sharded

# The fewest devices a sharded job gets: with one device each the pool above does the same, warm.
MIN_SHARE = 2


def device_shares(n_jobs: int, devices: list[str]) -> list[list[str]] | None:
    """The devices of each of n_jobs jobs when every job can have MIN_SHARE: contiguous groups of
    len(devices) // n_jobs, the first len(devices) % n_jobs one more, so no device stays idle (4 GPUs:
    1 job over 4, 2 jobs over 2 each; 3 jobs one each, which is the pool's way). None otherwise."""
    if n_jobs < 1 or len(devices) // n_jobs < MIN_SHARE:
        return None
    size, extra = divmod(len(devices), n_jobs)
    shares, start = [], 0
    for j in range(n_jobs):
        end = start + size + (j < extra)
        shares.append(list(devices[start:end]))
        start = end
    return shares


def sharded_jobs(jobs: list[Job], devices: list[str] | None) -> dict[int, list[str]]:
    """job.num -> its devices, for the jobs with work to do (not recorded already, runner.compare.has_work)
    when device_shares gives each at least MIN_SHARE; {} (one device per job, as before) otherwise, and also
    when any of them retrains (DistributedDataParallel would change the retrained weights by rounding: a
    retraining job stays on one device, so its row is the one-device row), when the devices are not of the
    kind the jobs compute on (backend=cpp jobs with GPUs listed), when a GPU is listed twice (NCCL takes
    one rank per GPU), or inside a process group already (torchrun)."""
    from runner import compare, distributed
    from runner.store import done_keys

    if not devices or len(devices) < MIN_SHARE or distributed.under_torchrun() or distributed.rank_world()[1] > 1:
        return {}
    recorded, pending = {}, []
    for job in jobs:
        if job.plan is None:  # it cannot run: it records its failure in this process
            continue
        results = str(job.cfg.results_file)
        if results not in recorded:
            recorded[results] = done_keys(Path(results))
        if compare.has_work(job.cfg, job.plan, recorded[results]):
            pending.append(job)
    shares = device_shares(len(pending), devices)
    if shares is None:
        return {}
    for job in pending:
        if "approx_finetuned" in job.plan.row_keys:
            return {}
        if any(d.partition(":")[0] != job.plan.device.type for d in devices):
            return {}
    if any(d.startswith("cuda") for d in devices) and len(set(devices)) < len(devices):
        return {}
    return {job.num: share for job, share in zip(pending, shares)}


def evaluate_sharded(cfg: DictConfig, out_dir: Path) -> dict:
    """A sharded job as one rank of its process group (runner.distributed.spawn_ranks): the compare run,
    whose evaluations deal their batches to the ranks (runner.evaluate.run_timed_sharded); rank 0 records."""
    from runner import compare

    return compare.run(cfg, out_dir, quiet=True)


def run_sharded(jobs: list[Job], shares: dict[int, list[str]], advance) -> None:
    """The jobs at once, each as a process group over its devices (one thread waits on each); each job's
    job.json, and a failed row for one whose rank died. Ctrl-C or SIGTERM (a KeyboardInterrupt here) stops
    every rank, then goes on up: nothing is recorded for the jobs stopped, every finished row stays."""
    import threading

    stop, lock = threading.Event(), threading.Lock()
    threads = [threading.Thread(target=_sharded_job, args=(job, shares[job.num], advance, lock, stop),
                                name=f"approx-run-job-{job.num}", daemon=True) for job in jobs]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # in short waits: a signal's KeyboardInterrupt reaches this (main) thread
    except KeyboardInterrupt:
        stop.set()
        for t in threads:
            t.join()
        raise


def _sharded_job(job: Job, devices: list[str], advance, lock, stop) -> None:
    from runner import compare, distributed
    from runner.provenance import atomic_write_json

    t0 = time.time()
    try:
        ranks = distributed.spawn_ranks("runner.jobs.run:evaluate_sharded", job.cfg, job.out_dir, devices, stop)
        failure = None if ranks.ok or ranks.interrupted else ranks.failure()
    except KeyboardInterrupt:  # stopped: the job is not run (a rerun does it)
        return
    except Exception as exc:  # noqa: BLE001  (the ranks could not start: this job fails, the others go on)
        ranks, failure = None, f"{type(exc).__name__}: {exc}"
    if ranks is not None and ranks.interrupted:
        return
    if failure is None:
        result = ranks.result if isinstance(ranks.result, dict) else {}
        status, error = str(result.get("status") or "ok"), str(result.get("error") or "")
    else:  # a rank failed (every rank raises rather than record it: runner.compare.run); recorded once, here
        status, error = "failed", f"sharded over {';'.join(devices)}: {failure}"
        with lock:
            compare.record_failed(job.cfg, job.out_dir, error, time.time() - t0)
    atomic_write_json(Path(job.out_dir) / "job.json", {
        "status": status, "error": error, "overrides": job.overrides, "elapsed_s": round(time.time() - t0, 3),
        "devices": ";".join(devices)})
    with lock:
        advance(1, **(job.label or {"job": job.num, "status": status}))
