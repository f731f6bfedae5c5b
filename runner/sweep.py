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

import copy
import fnmatch
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from runner.errors import UserError

_GLOB = set("*?[")


# ---------------------------------------------------------------- per job (inside the multirun)

def job_config(cfg: DictConfig) -> DictConfig:
    """The compare config of a job: sweep.multiplier (a name or a table file) replaces the multiplier group."""
    spec = cfg.get("sweep", {}).get("multiplier")
    if spec in (None, ""):
        return cfg
    spec = str(spec)
    node = ({"name": "file", "path": spec, "signed": None} if _is_path(spec) else {"name": spec})
    layers = cfg.multiplier.get("layers")
    if layers:
        node["layers"] = OmegaConf.to_container(layers, resolve=True)
    with open_dict(cfg):
        cfg.multiplier = OmegaConf.create(node)
    return cfg


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


def run(cfg: DictConfig, out_dir: Path, overrides: list[str] | None = None, quiet: bool = False,
        planned: tuple | None = None) -> dict:
    """One sweep job: a compare run; job.json records what happened for the sweep summary. quiet: no
    per-job table (the in-process loop shows progress, the summary the numbers)."""
    from runner import compare
    from runner.provenance import atomic_write_json

    t0 = time.time()
    if overrides is None and cfg.get("sweep", {}).get("chunk") is not None:  # a launcher task of many jobs
        _limit_threads()
        from runner import workers

        return workers.run_chunk(int(cfg.sweep.chunk), Path(out_dir).parent, run_in_process)
    if overrides is None:  # launched by Hydra (a parallel or cluster launcher)
        from hydra.core.hydra_config import HydraConfig

        _limit_threads()
        try:
            overrides = list(HydraConfig.get().overrides.task)
        except ValueError:
            overrides = []
    cfg = job_config(cfg)
    result = compare.run(cfg, out_dir, quiet=quiet, planned=planned)
    atomic_write_json(Path(out_dir) / "job.json", {
        "status": result.get("status"), "error": result.get("error", ""), "overrides": overrides,
        "elapsed_s": round(time.time() - t0, 3)})
    return result


# ---------------------------------------------------------------- the sweep (outside the multirun)

def _is_path(spec: str) -> bool:
    # The table formats are the loader's, matched as it matches them (case-insensitively); imported
    # here because runner.multipliers loads torch, which sweep's module level avoids.
    from runner.multipliers.io import SUFFIXES

    return os.sep in spec or "/" in spec or spec.lower().endswith(SUFFIXES)


def _unquote(s: str) -> str:
    s = s.strip()
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"" else s


def expand_multipliers(value: str, key: str = "sweep.multipliers") -> list[str]:
    """'mul8s_*', 'a,b', '[a, b]' -> names (globs matched against the registry) and absolute table paths;
    key: the setting it came from, for the messages."""
    from runner.multipliers import get, list_multipliers

    value = _unquote(value)
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    items = [_unquote(v) for v in value.split(",") if v.strip()]
    if not items:
        raise UserError(f"{key} is empty; give names, globs or table files, e.g. {key}='mul8s_*'.")
    names, known = [], list_multipliers()
    for item in items:
        if _is_path(item):
            names.append(str(Path(item).expanduser().resolve()))
        elif _GLOB & set(item):
            hits = fnmatch.filter(known, item)
            if not hits:
                raise UserError(f"{key}: {item!r} matches no multiplier. `approx-run lut list` shows them.")
            names += hits
        else:
            get(item)  # an unknown name is a typo: say so now (with suggestions), not after the sweep
            names.append(item)
    return list(dict.fromkeys(names))


def _hydra_quote(s: str) -> str:
    """s as a Hydra override value that parses back to s (Hydra's own escaping rules)."""
    from hydra.core.override_parser.types import Quote, QuotedString

    return QuotedString(text=s, quote=Quote.single).with_quotes()


def split_argv(argv: list[str], key: str = "sweep.multipliers"):
    """(Hydra flags, overrides, the value of `key` or None): `key` takes globs, which are not Hydra syntax."""
    flags = [a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")]
    overrides, multipliers = [], None
    for a in argv:
        if a.startswith("-"):
            continue
        name = a.split("=", 1)[0].lstrip("+~")
        if name == key:
            multipliers = a.split("=", 1)[1] if "=" in a else ""
        elif name == "sweep.multiplier":
            raise UserError("sweep.multiplier is set per job; use sweep.multipliers=... (a list or a glob).")
        else:
            overrides.append(a)
    return flags, overrides, multipliers


def expand_jobs(overrides: list[str]) -> list[list[str]]:
    """The job override lists Hydra's basic sweeper launches, in its order (job.num = index): the cartesian
    product of every comma-separated sweep, the last override varying fastest."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as exc:  # noqa: BLE001  (hydra's parse errors have several types)
        raise UserError(f"bad override for `approx-run sweep`: {exc}") from None
    axes = []
    for o in parsed:
        if o.is_hydra_override():
            continue
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                raise UserError(f"{o.input_line}: `approx-run sweep` takes comma-separated lists or choice(), "
                                "not ranges or intervals.")
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([f"{key}={o.get_value_element_as_str()}"])
    return [list(job) for job in itertools.product(*axes)]


def plan_jobs(argv: list[str]):
    """(Hydra flags, overrides for Hydra, each job's overrides, each job's config) of `approx-run sweep argv`."""
    flags, overrides, multipliers = split_argv(argv)
    if multipliers is not None:
        overrides.append("sweep.multiplier=" + ",".join(_hydra_quote(n) for n in expand_multipliers(multipliers)))
    if flags:
        return flags, overrides, [], []
    jobs = expand_jobs(overrides)
    cfgs = _compose_all(jobs, [o for o in overrides if o.lstrip("+~").startswith(("hydra.", "hydra/"))])
    return flags, overrides, jobs, cfgs


def _compose_all(jobs: list[list[str]], hydra_overrides: list[str]) -> list[DictConfig]:
    """Each job's config. Jobs that differ only in sweep.multiplier (a plain key) share one composition:
    Hydra takes a quarter of a second per composition, longer than a job's evaluation."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.config import CONFIG_DIR, HeldSignals, compose_errors

    parser = OverridesParser.create()
    composed: dict[tuple, DictConfig] = {}
    cfgs = []
    with HeldSignals(), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="sweep"):
        if hydra_overrides:  # a bad launcher or hydra.* override: say so first, before the jobs' errors
            with compose_errors("sweep", hint_launchers=True):
                compose(config_name="sweep", overrides=[*jobs[0], *hydra_overrides], return_hydra_config=True)
        for job in jobs:
            rest = tuple(o for o in job if not o.startswith("sweep.multiplier="))
            if rest not in composed:
                with compose_errors("sweep", job=job):
                    composed[rest] = compose(config_name="sweep", overrides=list(rest))
            cfg = copy.deepcopy(composed[rest])
            picked = [o for o in job if o.startswith("sweep.multiplier=")]
            if picked:
                with open_dict(cfg):
                    cfg.sweep.multiplier = parser.parse_override(picked[0]).value()
            cfgs.append(job_config(cfg))
    return cfgs


def _plan(cfg: DictConfig):
    """(compare.plan's answer, ""), or (None, the reason the job cannot run): it will then be recorded
    failed by the job itself."""
    from runner import compare

    try:
        return compare.plan(cfg), ""
    except UserError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"


def prepare(cfgs: list[DictConfig], plans: list, sweep_dir: Path) -> None:
    """Train each distinct baseline once and record each distinct pytorch/fakequant pair once, before the
    jobs, so parallel jobs neither train the same model nor time the same reference twice."""
    from runner import compare
    from runner.console import console
    from runner.store import done_keys
    from runner.train import checkpoint_path, load_or_train

    seen_ckpt, seen_ref = set(), set()
    for i, (cfg, (planned, _)) in enumerate(zip(cfgs, plans)):
        if planned is None:
            continue
        keys = planned[3]
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
                console.print(f"[bold]sweep:[/] reference rows ({', '.join(wanted)}) for job {i}")
                compare.run(ref_cfg, out, quiet=True)
        ckpt = str(checkpoint_path(cfg))
        if ckpt not in seen_ckpt:
            seen_ckpt.add(ckpt)
            load_or_train(cfg)


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


def summarize(sweep_dir: Path, jobs: list[list[str]], cfgs: list[DictConfig], plans: list) -> list[dict]:
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
    for num, (job, cfg, (planned, plan_error)) in enumerate(zip(jobs, cfgs, plans)):
        keys = planned[3] if planned else None
        rf = str(cfg.results_file)
        if rf not in ok_rows:
            ok_rows[rf] = {r.get("row_key"): r for r in read_rows(Path(rf)) if r.get("status") == "ok"}
        recorded = ok_rows[rf]
        job_dir, info = by_overrides.get(tuple(job), (sweep_dir / str(num), None))
        status = info["status"] if info else "not run"
        m = cfg.multiplier
        row = dict.fromkeys(SUMMARY_COLUMNS)
        row.update({"job": num, "multiplier": str(m.get("path") or m.get("name")) if m.get("name") in ("file", None)
                    else str(m.get("name")), "data": cfg.data.name, "model": cfg.model.name,
                    "quant": cfg.quant.get("name", ""), "backend": cfg.backend.name, "status": status,
                    "error": (info or {}).get("error") or plan_error, "overrides": " ".join(job),
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


def _basic_launcher(overrides: list[str]) -> bool:
    launcher = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("hydra/launcher=")]
    return not launcher or launcher[-1] == "basic"


def run_in_process(jobs: list[list[str]], cfgs: list[DictConfig], plans: list, sweep_dir: Path,
                   devices: list[str] | None = None, nums: list[int] | None = None) -> None:
    """What Hydra's basic launcher does, without composing every job again: the jobs one after another in
    this process, so they share its evaluation session (runner.session); with several devices, spread over
    a worker per device (runner.workers), this process serving the first. nums: the jobs' numbers (their
    directories), when they are some of a sweep's (a chunk)."""
    from runner import workers
    from runner.console import progress_bar
    from runner.provenance import write_config_yaml

    pooled = devices is not None and len(devices) > 1 and len(jobs) > 1
    tasks = []
    with progress_bar(f"sweep: {len(jobs)} jobs", total=len(jobs)) as advance:
        for num, job, cfg, (planned, _) in zip(nums or range(len(jobs)), jobs, cfgs, plans):
            out_dir = sweep_dir / str(num)
            out_dir.mkdir(parents=True, exist_ok=True)
            write_config_yaml(out_dir / "config.yaml", cfg)
            if pooled:
                tasks.append(workers.Task(num, (cfg, out_dir, job, True, planned)))
                continue
            result = run(cfg, out_dir, overrides=job, quiet=True, planned=planned)
            advance(1, job=num, status=result.get("status"))
        if tasks:
            workers.run_tasks(run, tasks, devices, advance, on_failure=_record_failure)


def _record_failure(task, error: str) -> None:
    """A job that ended without recording itself (its worker died): its job.json says so for the summary."""
    from runner.provenance import atomic_write_json

    _, out_dir, overrides, _, _ = task.args
    atomic_write_json(Path(out_dir) / "job.json", {"status": "failed", "error": error, "overrides": overrides,
                                                   "elapsed_s": None})


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
    from runner.cli import print_hydra_help

    print(__doc__.split("\n\n", 1)[0] + "\n")
    print_hydra_help("sweep")
    print("launchers:  hydra/launcher=joblib (parallel; hydra.launcher.n_jobs=N), hydra/launcher=submitit_local,\n"
          "            hydra/launcher=submitit_slurm (pip install 'approx-run[sweep]')\n"
          "resume:     rerun the same command; rows already recorded ok are skipped")


def main(argv: list[str] | None = None) -> int:
    from runner.cli import check_common, run_hydra_command
    from runner.console import console
    from runner.data import data_digest
    from runner.evaluate import check_eval_config
    from runner.store import check_store
    from runner.train import check_train_config
    from runner.workers import close_launcher_pools, devices_of, launch_chunks

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print_help()
        return 0
    flags, overrides, jobs, cfgs = plan_jobs(argv)
    if flags:  # --cfg, --info, ...: Hydra's own inspection, no sweep around it
        return run_hydra_command("sweep", ["-m", *flags, *overrides])
    for c in cfgs:  # settings shared by the jobs: a bad one stops the sweep before any work (exit 2)
        check_common(c)
        check_eval_config(c.eval)
        check_train_config(c)
    for data in {str(c.data): c.data for c in cfgs}.values():
        data_digest(data)  # missing or unreadable data files: one message now, not a failed row per job
    for results_file in dict.fromkeys(str(c.results_file) for c in cfgs):
        check_store(Path(results_file))  # a damaged results file stops the sweep here, not in every job
    devices = devices_of(cfgs, "sweep")
    sweep_dir = next((Path(o.split("=", 1)[1]) for o in overrides if o.startswith("hydra.sweep.dir=")), None)
    if sweep_dir is None:
        sweep_dir = Path(cfgs[0].paths.results) / "sweep" / time.strftime("%Y-%m-%d_%H-%M-%S")
        overrides.append(f"hydra.sweep.dir={sweep_dir}")
    overrides += _launcher_overrides(overrides, cfgs)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    console.print(f"[bold]sweep:[/] {len(jobs)} jobs -> {sweep_dir}")
    plans = [_plan(c) for c in cfgs]
    try:
        prepare(cfgs, plans, sweep_dir)
        if _basic_launcher(overrides):
            run_in_process(jobs, cfgs, plans, sweep_dir, devices=devices)
        elif int(cfgs[0].sweep.get("chunk_size") or 0) > 0:
            launch_chunks(jobs, cfgs, overrides, sweep_dir, lambda args: run_hydra_command("sweep", args))
            close_launcher_pools()
        else:
            run_hydra_command("sweep", ["-m", *overrides])
            close_launcher_pools()
    finally:  # also after Ctrl-C: the summary says which jobs are done
        summary = summarize(sweep_dir, jobs, cfgs, plans)
        _print_summary(summary, sweep_dir, time.time() - t0)
    failed = sum(r["status"] == "failed" for r in summary)
    if failed:  # the exit code says so too, for scripts and CI that do not read the table
        print(f"sweep: {failed} of {len(summary)} jobs failed (reasons above; recorded as failed rows). "
              "Fix them and rerun: rows recorded ok are not redone.", file=sys.stderr)
        return 1
    return 0
