"""`approx-run <command> [args]`: one console script, one subcommand per job.

train, compare, finetune, sweep, sensitivity, search and bench take Hydra overrides
(`data=mnist train.epochs=3`); the others (info, lut, results) take ordinary flags. The job layer
(runner.jobs) reads the command line and runs the jobs; this module maps commands to their code. Errors the user can fix print one paragraph
and exit with code 2, never a traceback."""
from __future__ import annotations

import importlib
import os
import signal
import sys

from runner.errors import UserError
from runner.jobs.argv import asks_for_help, command_line, wants_cuda
from runner.jobs.commands import GPU_COMMANDS, HYDRA_COMMANDS, print_hydra_help, print_usage
from runner.jobs.hydra_app import file_system_error, report_error, run_hydra_command


# command -> "module:function": run(cfg, out_dir) for the Hydra commands (runner.jobs.commands says which),
# main(argv) for the others
ENTRY_POINTS = {
    "train": "runner.train:run",
    "compare": "runner.compare:run_compare",
    "finetune": "runner.compare:run_finetune",
    "sweep": "runner.sweep:main",
    "sensitivity": "runner.sensitivity:main",
    "search": "runner.search:main",
    "bench": "runner.bench:run",
    "results": "runner.report:main",
    "lut": "runner.multipliers.cli:main",
    "info": "runner.info:main",
}


def entry_point(command: str):
    module, _, function = ENTRY_POINTS[command].partition(":")
    return getattr(importlib.import_module(module), function)


class Terminated(KeyboardInterrupt):
    """SIGTERM (SLURM's time limit or preemption, `kill`): stopped like Ctrl-C, with the sweep summary
    written and the resume hint, before the scheduler's SIGKILL."""


def _raise_terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    as_script = argv is None  # in-process callers (tests) keep their own signal handlers
    if as_script:
        signal.signal(signal.SIGTERM, _raise_terminated)
    rc = _main(command_line(argv))
    if as_script:
        # The work is done and recorded; a signal during interpreter shutdown would otherwise turn the
        # exit code into "killed by SIGINT".
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _exit_now_when_needed(rc)
    return rc


EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # Ctrl-C, SIGTERM: 128 + the signal, as shells report them


def _exit_now_when_needed(rc: int) -> None:
    """Exit now, with Python's exit handlers and the logs run but not the interpreter's teardown, when
    - this process imported torch: tearing down its modules and libraries (and a CUDA context, whose driver
      teardown can last as long as a whole small sweep's evaluations on a GPU) costs seconds of a short
      command's wall time on a small CPU too (benchmarks/README.md);
    - the run was interrupted: a KeyboardInterrupt raised inside exec() of a string (dataclasses build their
      methods so, as torch's import does) marks it unhandled in CPython even once caught, and a `python -m`
      run then ends killed by SIGINT (-2) instead of with our 130.
    Everything we write is closed by then (atomic renames, context managers)."""
    if rc not in (EXIT_INTERRUPTED, EXIT_TERMINATED) and "torch" not in sys.modules:
        return
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(rc)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print_usage()
        return 0
    command, args = argv[0], argv[1:]
    if command not in ENTRY_POINTS:
        print(f"approx-run: unknown command '{command}'\n", file=sys.stderr)
        print_usage(sys.stderr)
        return 2
    if command in GPU_COMMANDS and wants_cuda(args):
        from runner.gpus import warm_up_cuda

        warm_up_cuda()  # overlaps the composition, the data and the CPU-side set-up that follow
    try:
        if command in GPU_COMMANDS:
            from runner.gpus import check_cuda_environment

            check_cuda_environment()
        if command in HYDRA_COMMANDS:
            if asks_for_help(args):
                print_hydra_help(command)
                return 0
            if command == "bench" and "--algos" in args:  # cuDNN-style listing of every kernel variant
                args = [a for a in args if a != "--algos"] + ["bench.algos=true"]
            return run_hydra_command(command, args, entry_point(command))
        return int(entry_point(command)(args) or 0)
    except UserError as exc:
        report_error(exc)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        print("\ninterrupted: finished results are kept; rerun the same command to resume.", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (`approx-run lut list | head`): not an error of ours; silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        report_error(file_system_error(exc))
        return 1


if __name__ == "__main__":
    sys.exit(main())
