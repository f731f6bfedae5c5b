"""`approx-run <command> [args]`: one console script, one subcommand per job.

Hydra commands (train, compare, sweep, bench) take Hydra overrides (`data=mnist train.epochs=3`);
the others (info, lut, results) take ordinary flags. Errors the user can fix print one paragraph
and exit with code 2, never a traceback."""
from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from runner.config import CONFIG_DIR
from runner.errors import UserError, config_number


# command -> (module with run(cfg, out_dir) or main(argv), one-line help, hydra?)
COMMANDS = {
    "train": ("runner.train", "train the baseline LeNet-5 (fp32) and save its checkpoint", True),
    "compare": ("runner.compare", "accuracy/latency of pytorch fp32, fake-quant int8 and custom-MAC inference", True),
    "finetune": ("runner.finetune", "compare, plus the approx model retrained through its LUT layers", True),
    "sweep": ("runner.sweep", "run compare over many multipliers (Hydra multirun; resumable)", False),
    "sensitivity": ("runner.sensitivity", "accuracy with one layer approximated at a time, per multiplier; heat map", False),
    "search": ("runner.search", "a multiplier per layer: least energy within an accuracy budget (validation)", False),
    "bench": ("runner.bench", "time the LUT-MAC ops and whole models on each backend", True),
    "results": ("runner.report", "filter, pivot and plot results/results.csv", False),
    "lut": ("runner.multipliers.cli", "list, show and import multiplier look-up tables", False),
    "info": ("runner.info", "versions, device, available backends, data sources", False),
}

EXAMPLES = """examples:
  approx-run train                                  # LeNet-5 on the embedded 5,000 MNIST digits
  approx-run train data=fashion_mnist device=cuda
  approx-run compare multiplier=mul8s_1L2J backend=cpp
  approx-run finetune multiplier=mul8u_T83 finetune.epochs=3 finetune.grad=lut
  approx-run sweep sweep.multipliers='mul8s_*'
  approx-run sensitivity sensitivity.multipliers='mul8*'
  approx-run search search.multipliers='mul8*' search.max_loss=0.5
  approx-run lut list
  approx-run <command> --help                       # options and config groups of a command
"""


def print_usage(stream=sys.stdout) -> None:
    print("usage: approx-run <command> [options | hydra overrides]\n\ncommands:", file=stream)
    for name, (_, text, _) in COMMANDS.items():
        print(f"  {name:<11} {text}", file=stream)
    print("\n" + EXAMPLES, file=stream)


def report_error(exc: BaseException) -> None:
    from runner.console import err_console

    err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)


def file_system_error(exc: OSError) -> str:
    return f"{exc} (a file system error: check the path, its permissions and the free space; finished results are kept)"


def config_groups() -> dict[str, list[str]]:
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(CONFIG_DIR.iterdir()) if d.is_dir()}


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_shown, value)) + "]"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def print_keys(command: str, overrides=()) -> None:
    """Every key of the command with its default and its one line from the config files' comments, by
    section (the config groups' keys under the option they default to)."""
    from runner.config import key_help

    print("keys (key=default  what it does; set with key=value):")
    section = None
    for key, value, note in key_help(command, overrides):
        top = key.split(".", 1)[0] if "." in key else ""
        if top != section:
            section = top
            print(f"  {top + '.*' if top else 'top level'}")
        shown = f"{key}={_shown(value)}"
        print(f"    {shown:<40} {note}".rstrip() if len(shown) < 40 else f"    {shown}  {note}".rstrip())


def print_hydra_help(command: str) -> None:
    _, text, _ = COMMANDS[command]
    print(f"usage: approx-run {command} [key=value ...] [group=option ...] [-m]\n\n{text}\n")
    print(f"config: {CONFIG_DIR / (command + '.yaml')}\nconfig groups (choose with group=option):")
    for group, options in config_groups().items():
        print(f"  {group:<11} {', '.join(options)}")
    print()
    print_keys(command)
    print(f"\nshow the composed config: approx-run {command} --cfg job\n")
    print(EXAMPLES)


def asked_for_help(argv: list[str], command: str, doc: str, keys: str = "") -> bool:
    """For a command with its own main() over a Hydra config: print its help (the module docstring's first
    paragraph, the config groups, its own keys) and return True when argv asks for it."""
    if not any(a in ("-h", "--help") for a in argv):
        return False
    print(doc.split("\n\n", 1)[0] + "\n")
    print_hydra_help(command)
    if keys:
        print(keys)
    return True


def _validate_overrides(command: str, overrides: list[str]):
    """Compose once up front so a typo in an override is a clear exit-2 error rather than Hydra's exit 1."""
    from runner.config import compose

    cfg = compose(command, overrides)
    check_common(cfg)


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


def run_hydra_command(command: str, args: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from runner.config import HeldSignals
    from runner.provenance import write_config_yaml

    module = importlib.import_module(COMMANDS[command][0])
    multirun = any(a in ("-m", "--multirun") for a in args)
    hydra_flags = [a for a in args if a.startswith("-")]
    if not multirun and not hydra_flags:
        _validate_overrides(command, args)

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
            return module.run(cfg, out_dir)
        except UserError as exc:
            report_error(exc)
            sys.exit(exc.exit_code)
        except OSError as exc:  # a full disk, a vanished mount: say it plainly (Hydra would print a traceback)
            report_error(file_system_error(exc))
            sys.exit(1)

    sys.argv = [f"approx-run {command}", *args]
    # Hydra composes the config before it calls task. A multirun's parent may never call it (the joblib and
    # submitit launchers run the jobs elsewhere), so there signals are not held: a Ctrl-C must still stop it.
    with HeldSignals(hold=not multirun) as held:
        hydra.main(config_path=str(CONFIG_DIR), config_name=command, version_base="1.3")(task)()
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM (SLURM's time limit or preemption, `kill`): stopped like Ctrl-C, with the sweep summary
    written and the resume hint, before the scheduler's SIGKILL."""


def _raise_terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    as_script = argv is None  # in-process callers (tests) keep their own signal handlers
    if as_script:
        signal.signal(signal.SIGTERM, _raise_terminated)
    rc = _main(list(sys.argv[1:] if argv is None else argv))
    if as_script:
        # The work is done and recorded; a signal during interpreter shutdown would otherwise turn the
        # exit code into "killed by SIGINT".
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _exit_now_when_needed(rc)
    return rc


# the commands that evaluate models on the device their config names (bench times its own start-up)
GPU_COMMANDS = ("train", "compare", "finetune", "sweep", "sensitivity", "search")


def wants_cuda(args: list[str]) -> bool:
    """Whether the overrides run this command's work on a GPU, in this process: backend=cuda or device=cuda,
    and no launcher that would run the jobs in other processes."""
    keys = {}
    for a in args:
        key, eq, value = a.partition("=")
        if eq:
            keys[key.lstrip("+~")] = value
    if keys.get("hydra/launcher", "basic") != "basic":
        return False
    return "cuda" in keys.get("backend", "") or keys.get("device", "").startswith("cuda")


EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # Ctrl-C, SIGTERM: 128 + the signal, as shells report them


def _exit_now_when_needed(rc: int) -> None:
    """Exit now, with Python's exit handlers and the logs run but not the interpreter's teardown, when
    - this process holds a CUDA context: the driver's teardown of it at interpreter exit takes about a
      second on an H100 host, as long as a whole 19-table sweep's evaluations;
    - the run was interrupted: a KeyboardInterrupt raised inside exec() of a string (dataclasses build their
      methods so, as torch's import does) marks it unhandled in CPython even once caught, and a `python -m`
      run then ends killed by SIGINT (-2) instead of with our 130.
    Everything we write is closed by then (atomic renames, context managers)."""
    if rc not in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
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
    if command not in COMMANDS:
        print(f"approx-run: unknown command '{command}'\n", file=sys.stderr)
        print_usage(sys.stderr)
        return 2
    module_name, _, is_hydra = COMMANDS[command]
    if command in GPU_COMMANDS and wants_cuda(args):
        from runner.session import warm_up_cuda

        warm_up_cuda()  # overlaps the composition, the data and the CPU-side set-up that follow
    try:
        if is_hydra:
            if any(a in ("-h", "--help") for a in args):
                print_hydra_help(command)
                return 0
            if command == "bench" and "--algos" in args:  # cuDNN-style listing of every kernel variant
                args = [a for a in args if a != "--algos"] + ["bench.algos=true"]
            return run_hydra_command(command, args)
        return int(importlib.import_module(module_name).main(args) or 0)
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
