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


def run_jobs(jobs: list[Job], title: str, devices: list[str] | None = None) -> None:
    """The jobs in this process, each in its own run dir (config.yaml, job.json); with several devices,
    spread over a worker per device (runner.workers), this process serving the first."""
    from runner import workers
    from runner.console import console, fmt_seconds, progress_bar
    from runner.provenance import write_config_yaml

    pooled = devices is not None and len(devices) > 1 and len(jobs) > 1
    tasks = []
    console.print(title, highlight=False)  # the count of evaluations, before the first starts
    t0 = time.perf_counter()
    with progress_bar(title, total=len(jobs)) as advance:
        for i, job in enumerate(jobs):
            job.out_dir.mkdir(parents=True, exist_ok=True)
            write_config_yaml(job.out_dir / "config.yaml", job.cfg)
            if pooled:
                # jobs sharing fake-quant rows share calibration and references: one set-up to pre-warm
                setup = job.plan.row_keys["fakequant"] if job.plan else ""
                tasks.append(workers.Task(job.num, (job.cfg, job.out_dir, job.overrides, True, job.plan), setup))
                continue
            result = run_job(job.cfg, job.out_dir, overrides=job.overrides, quiet=True, plan=job.plan)
            if i == 0 and len(jobs) > 1 and result.get("status") != "skipped":
                # the first job also loads data, calibrates and runs the references: an upper bound per job
                first = time.perf_counter() - t0
                console.print(f"first evaluation (with the set-up) {fmt_seconds(first)}: the {len(jobs)} take at "
                              f"most about {fmt_seconds(first * len(jobs))}", highlight=False)
            advance(1, **(job.label or {"job": job.num, "status": result.get("status")}))
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
