"""A sweep's jobs on a cluster through a Hydra launcher: many jobs per launched task (chunks), each task running
its chunk in one process with one session; and the clean-up of the process pools launchers leave behind."""
from __future__ import annotations

import sys
from typing import Callable

from runner.errors import UserError
from runner.workers import devices_of, shard_setting

def close_launcher_pools() -> None:
    """Stop the worker processes a joblib launcher leaves behind (loky keeps them for reuse, idle for up to
    300 s). They end when the interpreter runs threading's exit hooks; a command that exits with
    os._exit (runner.cli, once torch is imported) would otherwise wait for them in multiprocessing's exit hook."""
    reusable = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(reusable, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=True)



CHUNKS_FILE = "chunks.json"


def write_chunks(sweep_dir, jobs: list[list[str]], chunk_size: int) -> int:
    """Cut the jobs (their override lists, numbered in order) into chunks of `chunk_size` for a launcher
    that starts one task per chunk (submitit: one SLURM array task keeps its session for a whole chunk),
    beside the jobs' configs, where every task reads it. Returns the number of chunks."""
    from pathlib import Path

    from runner.provenance import atomic_write_json

    if chunk_size < 1:
        raise UserError(f"sweep.chunk_size={chunk_size}: give a positive number of jobs per task (or 0: one task "
                        "per job).")
    numbered = [{"num": num, "overrides": list(job)} for num, job in enumerate(jobs)]
    chunks = [numbered[i:i + chunk_size] for i in range(0, len(numbered), chunk_size)]
    atomic_write_json(Path(sweep_dir) / CHUNKS_FILE, {"chunk_size": chunk_size, "chunks": chunks})
    return len(chunks)


def launch_chunks(jobs: list[list[str]], cfgs: list, overrides: list[str], sweep_dir, multirun: Callable) -> None:
    """A sweep's jobs through a Hydra launcher, sweep.chunk_size jobs per launched task: each task
    (run_chunk) runs its chunk in one process with one session, instead of one process, one data load
    and one calibration per job. The jobs' configs are written here, so a task composes only its chunk
    number. multirun(args): the sweep command's Hydra multirun over args."""
    from pathlib import Path

    from runner.provenance import write_config_yaml

    sweep_dir = Path(sweep_dir)
    for num, cfg in enumerate(cfgs):
        (sweep_dir / str(num)).mkdir(parents=True, exist_ok=True)
        write_config_yaml(sweep_dir / str(num) / "config.yaml", cfg)
    n = write_chunks(sweep_dir, jobs, int(cfgs[0].sweep.chunk_size))
    # one job's overrides (a task's own config is composed from them; its jobs bring their own configs),
    # the launcher's, and the chunk axis; the tasks' directories apart from the jobs' numbered ones
    base = [o for o in jobs[0] if not o.startswith("sweep.multiplier=")]
    launcher = [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    multirun(["-m", *base, *launcher, "sweep.chunk=" + ",".join(map(str, range(n))),
              "hydra.sweep.subdir=chunk${hydra.job.num}"])


def run_chunk(chunk: int, sweep_dir, run_jobs: Callable) -> dict:
    """One launched task: the jobs of its chunk, from the configs the sweep wrote, through
    run_jobs(jobs, title, devices=...) (runner.jobs.run.run_jobs) in this process, on this host's devices as
    sweep.devices says."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from runner.jobs.plan import Job

    sweep_dir = Path(sweep_dir)
    picked = read_chunk(sweep_dir, chunk)
    jobs = [Job(j["num"], j["overrides"], OmegaConf.load(sweep_dir / str(j["num"]) / "config.yaml"),
                sweep_dir / str(j["num"])) for j in picked]
    run_jobs(jobs, f"sweep chunk {chunk}: {len(jobs)} jobs", devices=devices_of([j.cfg for j in jobs], "sweep"),
             shard=shard_setting(jobs[0].cfg, "sweep"))
    return {"status": "ok", "jobs": [j.num for j in jobs]}


def read_chunk(sweep_dir, chunk: int) -> list[dict]:
    """The jobs ({num, overrides}) of one chunk written by write_chunks."""
    import json
    from pathlib import Path

    path = Path(sweep_dir) / CHUNKS_FILE
    try:
        chunks = json.loads(path.read_text())["chunks"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"sweep.chunk={chunk}: cannot read the sweep's chunk list {path} ({exc}); "
                        "sweep.chunk is set per task by `approx-run sweep`, not by hand.") from None
    if not 0 <= chunk < len(chunks):
        raise UserError(f"sweep.chunk={chunk}: the sweep has {len(chunks)} chunk(s) ({path}).")
    return chunks[chunk]
