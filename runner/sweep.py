"""`approx-run sweep`: `approx-run compare` over many multipliers, as a Hydra multirun.

    approx-run sweep sweep.multipliers='mul8s_*'                        # glob over the registry
    approx-run sweep sweep.multipliers=[exact,drum4_s,/tmp/t.txt]       # names and table files
    approx-run sweep multiplier=drum multiplier.k=2,4,6                 # a family's parameter grid
    approx-run sweep sweep.multipliers='mul8*' quant=per_channel_minmax,per_tensor_minmax backend=cpp,python
    approx-run sweep sweep.multipliers='mul8*' hydra/launcher=joblib    # parallel jobs
    approx-run sweep sweep.multipliers='mul8*' finetune.epochs=2        # and retrain each (approx_finetuned rows)

Before the jobs, the expansion is composed here once: the baseline of each distinct weight config is
trained (once, shared by every job), and the pytorch/fakequant rows of each distinct (data, model,
quant, signedness) are computed once, so jobs only compute their approx row. Jobs run with
skip_done (rows recorded ok are not recomputed: a rerun resumes) and on_error=record (a failing job
writes a failed row and the sweep goes on). Afterwards <sweep dir>/summary.csv holds one row per job."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from omegaconf import DictConfig, open_dict

from runner.config import refuse_lists
from runner.jobs.argv import (asks_for_help, command_line, expand_jobs, expand_multipliers, hydra_quote,
                              launcher_of, split_argv)
from runner.jobs.hydra_app import check_common, compose_jobs, run_hydra_command
from runner.errors import UserError
from runner.jobs.plan import Job, remove_if_bare, run_dir
from runner.jobs.run import format_schedule, plan_all, pool_tasks, run_job, run_jobs, start_pool
from runner.workers import shard_setting


# ---------------------------------------------------------------- the sweep

def sweep_jobs(argv: list[str]) -> tuple[list[str], list[str], list[Job]]:
    """(Hydra flags, overrides for Hydra, the jobs unplanned) of `approx-run sweep argv`; with flags
    (--cfg, --info) no jobs: Hydra inspects the config itself. A job's run dir is <sweep dir>/<job number>."""
    flags, overrides, multipliers = split_argv(argv)
    refuse_lists("sweep", overrides)  # before the jobs: a list would silently become one job
    if multipliers is not None:
        overrides.append("sweep.multiplier=" + ",".join(hydra_quote(n) for n in expand_multipliers(multipliers)))
    if flags:
        return flags, overrides, []
    job_overrides = expand_jobs(overrides)
    cfgs = compose_jobs("sweep", job_overrides, overrides)
    sweep_dir = next((Path(o.split("=", 1)[1]) for o in overrides if o.startswith("hydra.sweep.dir=")), None)
    if sweep_dir is None:
        sweep_dir = run_dir(cfgs[0], "sweep")
        overrides.append(f"hydra.sweep.dir={sweep_dir}")
    return flags, overrides, [Job(num, job, cfg, sweep_dir / str(num))
                              for num, (job, cfg) in enumerate(zip(job_overrides, cfgs))]


def prepare(jobs: list[Job], sweep_dir: Path) -> None:
    """Train each distinct baseline once and record each distinct pytorch/fakequant pair once, before the
    jobs, so parallel jobs neither train the same model nor time the same reference twice."""
    from runner import compare
    from runner.console import console
    from runner.store import done_keys
    from runner.train import checkpoint_path, load_or_train

    seen_ckpt, seen_ref, seen_weights = set(), set(), set()
    for job in jobs:
        if job.plan is None:
            continue
        cfg, keys = job.cfg, job.plan.row_keys
        ref = (str(cfg.results_file), keys["pytorch"], keys["fakequant"])
        if cfg.sweep.get("reference", True) and ref not in seen_ref:
            seen_ref.add(ref)
            seen_ckpt.add(str(checkpoint_path(cfg)))
            wanted = [p for p in ("pytorch", "fakequant") if p in cfg.eval.paths]
            if wanted and not set(keys[p] for p in wanted) <= done_keys(Path(cfg.results_file)):
                ref_cfg = cfg.copy()
                with open_dict(ref_cfg):
                    ref_cfg.eval.paths = wanted
                out = sweep_dir / "reference" / str(len(seen_ref) - 1)
                out.mkdir(parents=True, exist_ok=True)
                console.print(f"[bold]sweep:[/] reference rows ({', '.join(wanted)}) for job {job.num}")
                # the job's plan holds for its reference run: eval.paths is in no row key, nothing it plans
                compare.run(ref_cfg, out, quiet=True, plan=job.plan)
        # the pytorch row key holds the weight config: jobs that share it and the checkpoint dir share a baseline
        weights = (keys["pytorch"], str(cfg.paths.checkpoints))
        if weights in seen_weights:
            continue
        seen_weights.add(weights)
        ckpt = str(checkpoint_path(cfg))
        if ckpt not in seen_ckpt:
            seen_ckpt.add(ckpt)
            load_or_train(cfg)


# <sweep dir>/schedule.json: each job's device, start and end, each process's milestones (runner.jobs.run.schedule_of)
SCHEDULE_FILE = "schedule.json"

SUMMARY_COLUMNS = ["job", "multiplier", "data", "model", "quant", "backend", "status", "recorded_at", "accuracy",
                   "fp32_accuracy", "fakequant_accuracy", "finetuned_accuracy", "agreement_fakequant", "latency_ms_median",
                   "throughput_img_s", "mult_mae_pct", "published_power_mw", "mult_energy_rel", "op_acc_nrmse",
                   "elapsed_s", "error",
                   "overrides", "row_key", "job_dir"]


def _value(cell: str):
    """A results-file cell as the number it holds ("" is missing)."""
    if cell == "":
        return None
    for kind in (int, float):
        try:
            return kind(cell)
        except ValueError:
            pass
    return cell


def summarize(sweep_dir: Path, jobs: list[Job]) -> list[dict]:
    """One row per job: its status (ok / skipped: already recorded / failed / not run) and its rows' numbers,
    looked up by row key in the results file, so resumed jobs show the numbers recorded earlier."""
    import json

    from runner.store import read_rows, write_csv

    by_overrides = {}
    for f in sweep_dir.glob("*/job.json"):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        by_overrides[tuple(info.get("overrides", []))] = (f.parent, info)
    ok_rows = {}  # results file -> row key -> its last row recorded ok
    rows = []
    for job in jobs:
        num, cfg, keys = job.num, job.cfg, job.plan.row_keys if job.plan else None
        rf = str(cfg.results_file)
        if rf not in ok_rows:
            ok_rows[rf] = {r.get("row_key"): r for r in read_rows(Path(rf)) if r.get("status") == "ok"}
        recorded = ok_rows[rf]
        job_dir, info = by_overrides.get(tuple(job.overrides), (sweep_dir / str(num), None))
        status = info["status"] if info else "not run"
        m = cfg.multiplier
        row = dict.fromkeys(SUMMARY_COLUMNS)
        row.update({"job": num, "multiplier": str(m.get("path") or m.get("name")) if m.get("name") in ("file", None)
                    else str(m.get("name")), "data": cfg.data.name, "model": cfg.model.name,
                    "quant": cfg.quant.get("name", ""), "backend": cfg.backend.name, "status": status,
                    "error": (info or {}).get("error") or job.plan_error, "overrides": " ".join(job.overrides),
                    "elapsed_s": (info or {}).get("elapsed_s"), "job_dir": str(job_dir),
                    "row_key": keys["approx"] if keys else ""})
        if keys:
            a = recorded.get(keys["approx"])
            if a is not None:
                row["multiplier"] = a.get("multiplier") or row["multiplier"]
                for c in ("accuracy", "agreement_fakequant", "latency_ms_median", "throughput_img_s",
                          "mult_mae_pct", "published_power_mw", "mult_energy_rel", "op_acc_nrmse"):
                    row[c] = _value(a.get(c, ""))
                row["recorded_at"] = a.get("timestamp") or None
                if status == "skipped":  # timed by an earlier run, maybe on a busier machine: not this sweep's
                    row["latency_ms_median"] = row["throughput_img_s"] = None
                if status == "failed":  # an earlier failure, since recorded ok by a concurrent sweep
                    row["status"] = "ok"
            for path, col in (("pytorch", "fp32_accuracy"), ("fakequant", "fakequant_accuracy"),
                              ("approx_finetuned", "finetuned_accuracy")):
                r = recorded.get(keys.get(path))  # ok rows always have a key: a missing path finds none
                row[col] = None if r is None else _value(r.get("accuracy", ""))
        rows.append(row)
    write_csv(sweep_dir / "summary.csv", rows)
    return rows


def _print_summary(summary: list[dict], sweep_dir: Path, elapsed: float) -> None:
    from collections import Counter

    from runner.console import print_table

    cols = ["job", "multiplier", "quant", "backend", "status", "accuracy", "fp32_accuracy", "fakequant_accuracy",
            "finetuned_accuracy", "latency_ms_median", "mult_mae_pct", "op_acc_nrmse", "mult_energy_rel"]
    if all(r["finetuned_accuracy"] is None for r in summary):
        cols.remove("finetuned_accuracy")
    for c in ("quant", "backend"):
        if len({r[c] for r in summary}) <= 1:
            cols.remove(c)
    print_table(summary, title=f"approx-run sweep: {len(summary)} jobs in {elapsed:.1f}s", columns=cols)
    counts = Counter(r["status"] for r in summary).most_common()
    print(f"sweep: {', '.join(f'{v} {k}' for k, v in counts)}; summary {sweep_dir / 'summary.csv'}")
    if any(r["status"] == "skipped" for r in summary):
        print("  skipped: already recorded (at recorded_at in the summary); their numbers are the recorded ones, "
              "their latencies left out (timed by that earlier run; results.csv has them)")
    for r in summary:
        if r["status"] == "failed":
            print(f"  failed job {r['job']} ({r['multiplier']}): {str(r['error']).splitlines()[0] if r['error'] else ''}")


def _launcher_overrides(overrides: list[str], cfgs: list[DictConfig]) -> list[str]:
    """With the joblib launcher and CUDA jobs, as many parallel jobs as GPUs; each job leases a free GPU
    (runner.gpus.gpu_lease), so no two jobs share one."""
    if not any(o.lstrip("+") == "hydra/launcher=joblib" for o in overrides):
        return []
    if any(o.lstrip("+").startswith("hydra.launcher.n_jobs=") for o in overrides):
        return []
    if not any(c.backend.name == "cuda" or c.device == "cuda" for c in cfgs):
        return []
    import torch

    return [f"hydra.launcher.n_jobs={max(1, torch.cuda.device_count())}"]


def print_help() -> None:
    from runner.jobs.commands import print_command_help

    print_command_help("sweep", __doc__)
    print("launchers:  hydra/launcher=joblib (parallel; hydra.launcher.n_jobs=N), hydra/launcher=submitit_local,\n"
          "            hydra/launcher=submitit_slurm (pip install 'approx-run[sweep]')\n"
          "resume:     rerun the same command; rows already recorded ok are skipped")


def main(argv: list[str] | None = None) -> int:
    from runner.evaluate import check_eval_config
    from runner.train import check_train_config
    from runner.workers import devices_of

    clock0 = time.monotonic()  # the sweep's schedule counts from here
    argv = command_line(argv)
    if asks_for_help(argv):
        print_help()
        return 0
    flags, overrides, jobs = sweep_jobs(argv)
    if flags:  # --cfg, --info, ...: Hydra's own inspection, no sweep around it
        return run_hydra_command("sweep", ["-m", *flags, *overrides], run_job)
    cfgs = [job.cfg for job in jobs]
    for c in cfgs:  # settings shared by the jobs: a bad one stops the sweep before any work (exit 2)
        check_common(c)
        check_eval_config(c.eval)
        check_train_config(c)
    devices = devices_of(cfgs, "sweep")
    # the workers start now: their interpreter, torch, CUDA context and imports overlap what follows here
    pool = start_pool(jobs, devices, shard_setting(cfgs[0], "sweep")) if launcher_of(overrides) == "basic" else None
    try:
        return _main(jobs, cfgs, overrides, devices, pool, clock0)
    finally:
        if pool is not None:
            pool.close()


def baselines_exist(jobs: list[Job]) -> bool:
    """Whether every planned job's baseline is there already (given weights, or a checkpoint not to be
    retrained): the pool's workers may then build their sessions while this process records the references."""
    from runner.train import checkpoint_path, pretrained

    return all(pretrained(job.cfg.model) or (checkpoint_path(job.cfg).exists() and not job.cfg.train.get("force"))
               for job in jobs if job.plan is not None)


def _main(jobs: list[Job], cfgs: list[DictConfig], overrides: list[str], devices: list[str], pool,
          clock0: float) -> int:
    from runner.compare import preflight
    from runner.console import console
    from runner.data import data_digest
    from runner.errors import config_number
    from runner.provenance import atomic_write_json
    from runner.store import check_store
    from runner.jobs.chunks import close_launcher_pools, launch_chunks

    for data in {str(c.data): c.data for c in cfgs}.values():
        data_digest(data)  # missing or unreadable data files: one message now, not a failed row per job
    for results_file in dict.fromkeys(str(c.results_file) for c in cfgs):
        check_store(Path(results_file))  # a damaged results file stops the sweep here, not in every job
    preflight(cfgs)  # backend/device, model and layers, the model on the data: once, not a failed row per job
    shard = shard_setting(cfgs[0], "sweep")
    # 0: one launched task per job; a typo (-1, 2.5) stops here, not after the reference rows
    chunk_size = config_number(cfgs[0].sweep.get("chunk_size") or 0, "sweep.chunk_size", minimum=0)
    sweep_dir = jobs[0].out_dir.parent
    overrides += _launcher_overrides(overrides, cfgs)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    console.print(f"[bold]sweep:[/] {len(jobs)} jobs -> {sweep_dir}")
    plan_all(jobs)
    if pool is not None and baselines_exist(jobs):
        pool.send(pool_tasks(jobs))  # the workers pre-warm while this process records the reference rows
    stopped = False  # by a user error before any job ran (a damaged checkpoint): no summary, no sweep dir
    try:
        prepare(jobs, sweep_dir)
        if launcher_of(overrides) == "basic":
            schedule = run_jobs(jobs, f"sweep: {len(jobs)} jobs", devices=devices, shard=shard, pool=pool,
                                clock0=clock0)
            atomic_write_json(sweep_dir / SCHEDULE_FILE, schedule)
            if len(devices) > 1:  # where each device's time went (benchmarks/ddp_gpu.sh prints it)
                print(f"sweep schedule (seconds since the sweep began; {sweep_dir / SCHEDULE_FILE}):\n"
                      + "\n".join(format_schedule(schedule)), flush=True)
        elif chunk_size > 0:
            launch_chunks([job.overrides for job in jobs], cfgs, overrides, sweep_dir,
                          lambda args: run_hydra_command("sweep", args, run_job))
            close_launcher_pools()
        else:
            run_hydra_command("sweep", ["-m", *overrides], run_job)
            close_launcher_pools()
    except UserError:
        stopped = remove_if_bare(sweep_dir, Path(str(cfgs[0].paths.results)))
        raise
    finally:  # also after Ctrl-C: the summary says which jobs are done
        if not stopped:
            summary = summarize(sweep_dir, jobs)
            _print_summary(summary, sweep_dir, time.time() - t0)
    failed = sum(r["status"] == "failed" for r in summary)
    if failed:  # the exit code says so too, for scripts and CI that do not read the table
        print(f"sweep: {failed} of {len(summary)} jobs failed (reasons above; recorded as failed rows). "
              "Fix them and rerun: rows recorded ok are not redone.", file=sys.stderr)
        return 1
    return 0
