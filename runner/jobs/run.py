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
        from runner.jobs import chunks

        _limit_threads()
        return chunks.run_chunk(int(cfg.sweep.chunk), Path(out_dir).parent, run_jobs)
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


def pool_tasks(jobs: list[Job]):
    """The pool's tasks of the jobs (runner.workers.Task: run_job's args), in order."""
    from runner import workers

    # jobs sharing fake-quant rows share calibration and references: one set-up to pre-warm
    return [workers.Task(job.num, (job.cfg, job.out_dir, job.overrides, True, job.plan),
                         job.plan.row_keys["fakequant"] if job.plan else "") for job in jobs]


def start_pool(jobs: list[Job], devices: list[str] | None, shard: bool = True):
    """The worker pool for these jobs, started now (runner.workers.Pool: its workers import torch, start their
    GPU and import the jobs' modules while this process composes, checks, plans and records the references),
    or None when the jobs will run in this process (one device, one job) or may be few enough to be sharded
    (run_jobs decides that once they are planned, and starts a pool then if they are not)."""
    from runner import workers

    if devices is None or len(devices) < 2 or len(jobs) < 2:
        return None
    if shard and device_shares(len(jobs), devices) is not None:
        return None
    return workers.Pool(run_job, devices, len(jobs), prepare=prepare_job, imports=POOL_IMPORTS)


# what a pool's workers import while they wait for their tasks (the jobs' modules: torch's submodules, the
# C++/CUDA extension, the models)
POOL_IMPORTS = ("runner.compare", "runner.finetune")


def run_jobs(jobs: list[Job], title: str, devices: list[str] | None = None, shard: bool = True, pool=None,
             clock0: float | None = None) -> dict:
    """The jobs in this process, each in its own run dir (config.yaml, job.json); with several devices,
    spread over a worker per device (runner.workers), this process serving the first; or, when the jobs
    with work to do are fewer than the devices (shard, sharded_jobs), each of them over its share of the
    devices at once, its images sharded (run_sharded). pool: one started early for these jobs (start_pool),
    used or closed here. Returns the schedule (schedule_of): each job's device and its start and end in
    seconds since clock0 (a time.monotonic(); default: this call's start), and when each process was ready."""
    from runner import workers
    from runner.console import console, fmt_seconds, progress_bar
    from runner.provenance import write_config_yaml

    clock0 = time.monotonic() if clock0 is None else clock0
    shares = sharded_jobs(jobs, devices) if shard else {}
    pooled = not shares and devices is not None and len(devices) > 1 and len(jobs) > 1
    if pool is not None and not pooled:
        pool.close()
        pool = None
    here = devices[0] if devices else ""
    timed: list[dict] = []
    tasks = []
    console.print(title, highlight=False)  # the count of evaluations, before the first starts
    t0, first = time.perf_counter(), None
    try:
        with progress_bar(title, total=len(jobs)) as advance:
            for i, job in enumerate(jobs):
                job.out_dir.mkdir(parents=True, exist_ok=True)
                write_config_yaml(job.out_dir / "config.yaml", job.cfg)
                if job.num in shares:  # below, all at once
                    continue
                if pooled:
                    continue
                started = time.monotonic()
                result = run_job(job.cfg, job.out_dir, overrides=job.overrides, quiet=True, plan=job.plan)
                timed.append({"job": job.num, "device": here, "worker": 0, "status": result.get("status"),
                              "started": started, "ended": time.monotonic()})
                if i == 0 and len(jobs) > 1 and not shares and result.get("status") != "skipped":
                    # the first job also loads data, calibrates and runs the references: an upper bound per job
                    first = time.perf_counter() - t0
                    console.print(f"first evaluation (with the set-up) {fmt_seconds(first)}: the {len(jobs)} take "
                                  f"at most about {fmt_seconds(first * len(jobs))}", highlight=False)
                elif i == 1 and first is not None and len(jobs) > 2 and result.get("status") != "skipped":
                    # the set-up dwarfs an evaluation at ImageNet scale (56 s against 3 s): the second is the pace
                    second = time.perf_counter() - t0 - first
                    console.print(f"second evaluation {fmt_seconds(second)}: the {len(jobs)} take about "
                                  f"{fmt_seconds(first + second * (len(jobs) - 1))}", highlight=False)
                advance(1, **(job.label or {"job": job.num, "status": result.get("status")}))
            if shares:
                run_sharded([job for job in jobs if job.num in shares], shares, advance, timed)
            if pooled:
                tasks = pool_tasks(jobs)
                pool = pool or workers.Pool(run_job, devices, len(tasks), prepare=prepare_job, imports=POOL_IMPORTS)
                outcomes = pool.run(tasks, advance, on_failure=record_failure)
                tasks = pool.tasks  # those sent early, if they were (the same jobs, in order)
                timed += [{"job": tasks[o.num].num, "device": o.device, "worker": o.worker, "status": o.status,
                           "started": o.started, "ended": o.ended} for o in outcomes]
    finally:
        if pool is not None:
            pool.close()
    return schedule_of(timed, devices or [here], clock0, pool.milestones() if pool is not None else {})


def schedule_of(timed: list[dict], devices: list[str], clock0: float, milestones: dict) -> dict:
    """The schedule of a command's jobs, in seconds since clock0: per job its device, worker (0: this process)
    and start and end; per process its device, its milestones (up: imports done, tasks: received, ready:
    pre-warmed and claiming) and the jobs it ran."""
    def rel(t):
        return None if t is None else round(t - clock0, 3)

    jobs = [{**{k: v for k, v in t.items() if k not in ("started", "ended")},
             "started_s": rel(t["started"]), "ended_s": rel(t["ended"])} for t in timed]
    jobs.sort(key=lambda j: (j["started_s"] is None, j["started_s"] or 0, j["job"]))
    processes = []
    for wid, device in enumerate(devices):
        mine = [j["job"] for j in jobs if j.get("worker") == wid and j["device"] == device]
        processes.append({"worker": wid, "device": device,
                          **{f"{k}_s": rel(v) for k, v in milestones.get(wid, {}).items()}, "jobs": mine})
    return {"jobs": jobs, "processes": processes}


def format_schedule(schedule: dict) -> list[str]:
    """One line per process of a schedule (schedule_of): where its time went, in seconds since the start."""
    by_job = {j["job"]: j for j in schedule["jobs"]}
    lines = []
    for p in schedule["processes"]:
        marks = ", ".join(f"{k[:-2]} {p[k]:.1f}" for k in ("up_s", "tasks_s", "ready_s") if p.get(k) is not None)
        runs = ", ".join(f"job {n} {by_job[n]['started_s']:.1f}-{by_job[n]['ended_s']:.1f}"
                         for n in p["jobs"] if by_job[n]["started_s"] is not None)
        who = "this process" if p["worker"] == 0 else f"worker {p['worker']}"
        lines.append(f"  {p['device'] or 'here'} ({who}): {len(p['jobs'])} jobs"
                     f"{'; ' + marks if marks else ''}{': ' + runs if runs else ''}")
    sharded = [j for j in schedule["jobs"] if j.get("worker") is None and j["started_s"] is not None]
    for j in sharded:
        lines.append(f"  {j['device']} (sharded): job {j['job']} {j['started_s']:.1f}-{j['ended_s']:.1f}")
    return lines


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


def run_sharded(jobs: list[Job], shares: dict[int, list[str]], advance, timed: list | None = None) -> None:
    """The jobs at once, each as a process group over its devices (one thread waits on each); each job's
    job.json, and a failed row for one whose rank died. Ctrl-C or SIGTERM (a KeyboardInterrupt here) stops
    every rank, then goes on up: nothing is recorded for the jobs stopped, every finished row stays."""
    import threading

    stop, lock = threading.Event(), threading.Lock()
    threads = [threading.Thread(target=_sharded_job, args=(job, shares[job.num], advance, lock, stop, timed),
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


def _sharded_job(job: Job, devices: list[str], advance, lock, stop, timed: list | None = None) -> None:
    from runner import compare, distributed
    from runner.provenance import atomic_write_json

    t0, started = time.time(), time.monotonic()
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
        if timed is not None:
            timed.append({"job": job.num, "device": ";".join(devices), "worker": None, "status": status,
                          "started": started, "ended": time.monotonic()})
        advance(1, **(job.label or {"job": job.num, "status": status}))
