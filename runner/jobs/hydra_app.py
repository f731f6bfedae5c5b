"""Hydra's side of the job layer: running a command through hydra.main (its flags, launchers and run dir),
composing every job of a sweep, and the checks every command's config gets before any work.

Why sweeps compose here instead of through Hydra's sweeper: with the basic launcher, a sweep's jobs run in
this process (runner.jobs.run) and share its session, and jobs that differ only in their multiplier share
one composition (a Hydra composition takes longer than a LeNet-5 job's evaluation). Other
launchers (joblib, submitit) get the same overrides through hydra.main and Hydra's own sweeper."""
from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from runner.config import CONFIG_DIR, HeldSignals, compose, compose_errors, refuse_lists
from runner.errors import UserError, config_number
from runner.jobs.argv import (asks_for_help, command_line, expand_multipliers, hydra_flags, is_hydra_override,
                             is_multirun, set_program_argv, split_argv)
from runner.jobs.plan import remove_if_bare, with_multiplier

if TYPE_CHECKING:  # omegaconf is imported where it is used: `approx-run info` and `lut` start without it
    from omegaconf import DictConfig


def report_error(exc: BaseException | str) -> None:
    from rich.markup import escape

    from runner.console import err_console

    # escaped: a message quoting a list (multiplier=[exact,mul8s_1L2J]) is not rich markup
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)


def file_system_error(exc: OSError) -> str:
    return f"{exc} (a file system error: check the path, its permissions and the free space; finished results are kept)"


def check_common(cfg) -> None:
    """The keys every command shares: an integer seed, and output dirs that can be created and written
    (Hydra would otherwise fail creating its run dir with a traceback)."""
    config_number(cfg.seed, "seed")
    for key in ("results", "checkpoints"):
        path = Path(str(cfg.paths[key]))
        try:
            path.mkdir(parents=True, exist_ok=True)
            writable = os.access(path, os.W_OK)
        except OSError as exc:
            writable, why = False, exc.strerror
        else:
            why = "not writable"
        if not writable:
            raise UserError(f"paths.{key}={path} cannot be used ({why}); choose a directory you can write, "
                            f"e.g. paths.{key}=$HOME/approx-run/{key}.")


def run_hydra_command(command: str, args: list[str], task_fn: Callable[[DictConfig, Path], object]) -> int:
    """`approx-run <command> args` through hydra.main: task_fn(cfg, out_dir) runs once per job (once, or per
    job of a multirun on its launcher)."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from runner.provenance import write_config_yaml

    multirun = is_multirun(args)
    if not multirun and not hydra_flags(args):
        # compose once up front so a typo in an override is a clear exit-2 error rather than Hydra's exit 1
        check_common(compose(command, args))

    def task(cfg):
        held.release()
        if multiprocessing.current_process().name != "MainProcess":
            # A launcher's worker (joblib's loky processes). Ctrl-C reaches the whole process group; the parent
            # stops its workers itself, and a worker interrupted between two jobs would print a traceback.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        write_config_yaml(out_dir / "config.yaml", cfg)
        try:
            check_common(cfg)  # again here: `-m` runs skip the up-front compose
            return task_fn(cfg, out_dir)
        except UserError as exc:
            report_error(exc)
            remove_if_bare(out_dir, Path(str(cfg.paths.results)))  # Hydra made it before the error: nothing in it
            sys.exit(exc.exit_code)
        except OSError as exc:  # a full disk, a vanished mount: say it plainly (Hydra would print a traceback)
            report_error(file_system_error(exc))
            sys.exit(1)

    args = _other_ranks_write_nothing(args)
    set_program_argv(command, args)
    # Hydra composes the config before it calls task. A multirun's parent may never call it (the joblib and
    # submitit launchers run the jobs elsewhere), so there signals are not held: a Ctrl-C must still stop it.
    with HeldSignals(hold=not multirun) as held:
        hydra.main(config_path=str(CONFIG_DIR), config_name=command, version_base="1.3")(task)()
    return 0


def _other_ranks_write_nothing(args: list[str]) -> list[str]:
    """Under torchrun every rank runs the command; rank 0's run dir is the run's, the others' Hydra output goes
    to a temporary directory removed at exit (runner.distributed: rank 0 alone writes)."""
    import atexit
    import shutil
    import tempfile

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("RANK", "0") == "0":
        return args
    tmp = tempfile.mkdtemp(prefix=f"approx-run-rank{os.environ['RANK']}-")
    atexit.register(shutil.rmtree, tmp, True)
    return [*args, f"hydra.run.dir={tmp}", "hydra.output_subdir=null"]


def compose_jobs(command: str, jobs: list[list[str]], overrides: list[str]) -> list[DictConfig]:
    """Each job's config (jobs: each job's overrides; overrides: the command line's, for its hydra.* ones).
    Jobs that differ only in sweep.multiplier (a plain key) share one composition, and every job's config
    comes resolved (resolve_in_place, resolved_once)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import open_dict

    parser = OverridesParser.create()
    hydra_overrides = [o for o in overrides if is_hydra_override(o)]
    composed: dict[tuple, tuple[DictConfig, bool]] = {}  # overrides but the multiplier -> (config, resolved)
    cfgs = []
    with HeldSignals(), initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=command):
        if hydra_overrides:  # a bad launcher or hydra.* override: say so first, before the jobs' errors
            with compose_errors(command, hint_launchers=True):
                hydra_compose(config_name=command, overrides=[*jobs[0], *hydra_overrides], return_hydra_config=True)
        for job in jobs:
            rest = tuple(o for o in job if not o.startswith("sweep.multiplier="))
            if rest not in composed:
                with compose_errors(command, job=job):
                    composed[rest] = resolved_once(hydra_compose(config_name=command, overrides=list(rest)))
            shared, is_resolved = composed[rest]
            cfg = copy.deepcopy(shared)
            picked = [o for o in job if o.startswith("sweep.multiplier=")]
            if picked:
                with open_dict(cfg):
                    cfg.sweep.multiplier = parser.parse_override(picked[0]).value()
            cfg = with_multiplier(cfg)
            if not is_resolved:
                resolve_in_place(cfg)
            cfgs.append(cfg)
    return cfgs


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def resolve_in_place(cfg: DictConfig) -> None:
    """Replace cfg's interpolations by their values. OmegaConf parses an interpolation again on every read
    (with its ANTLR grammar), and a job reads its config many times (planning, row keys, checkpoint name,
    config.yaml, run.json), each time the same value once the job's config is final. An interpolation that
    cannot be resolved stays as it is (the others are resolved): the job that reads it reports it, as it
    would have."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException:
        pass


def resolved_once(cfg: DictConfig) -> tuple[DictConfig, bool]:
    """(the composition the jobs copy, whether it is final). Resolved once here (resolve_in_place) unless an
    interpolation may read the multiplier (or sweep.multiplier), which each job sets: then each job's
    config is resolved after its multiplier is set (compose_jobs)."""
    from omegaconf import OmegaConf

    if any("${" in s and "multiplier" in s for s in _strings(OmegaConf.to_container(cfg, resolve=False))):
        return cfg, False
    resolve_in_place(cfg)
    return cfg, True


def compose_command(command: str, argv: list[str] | None, key: str, doc: str, keys_help: str):
    """(config, expanded multiplier names) of `approx-run <command> argv`, key naming the multiplier set;
    None when argv asks for the help, which is then printed (doc's first paragraph and keys_help)."""
    from runner.jobs.commands import print_command_help

    argv = command_line(argv)
    if asks_for_help(argv):
        print_command_help(command, doc, keys_help)
        return None
    flags, overrides, value = split_argv(argv, key)
    if flags:
        raise UserError(f"`approx-run {command}` takes key=value overrides only, not {' '.join(flags)}.")
    refuse_lists(command, overrides)  # multiplier=[a,b] is a multiplier set given to the wrong key: say which
    if value is None:
        raise UserError(f"`approx-run {command}` needs a multiplier set: {key}='mul8*' (names, globs or files).")
    names = expand_multipliers(value, key)
    return compose(command, overrides), names
