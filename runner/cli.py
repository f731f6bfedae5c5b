"""`approx-run <command> [args]`: one console script, one subcommand per job.

Hydra commands (train, compare, sweep, bench) take Hydra overrides (`data=mnist train.epochs=3`);
the others (info, lut, results) take ordinary flags. Errors the user can fix print one paragraph
and exit with code 2, never a traceback."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from runner.config import CONFIG_DIR
from runner.errors import UserError


# command -> (module with run(cfg, out_dir) or main(argv), one-line help, hydra?)
COMMANDS = {
    "train": ("runner.train", "train the baseline LeNet-5 (fp32) and save its checkpoint", True),
    "compare": ("runner.compare", "accuracy/latency of pytorch fp32, fake-quant int8 and custom-MAC inference", True),
    "finetune": ("runner.finetune", "compare, plus the approx model retrained through its LUT layers", True),
    "sweep": ("runner.sweep", "run compare over many multipliers (Hydra multirun; resumable)", False),
    "sensitivity": ("runner.sensitivity", "accuracy with one layer approximated at a time, per multiplier; heat map", False),
    "search": ("runner.search", "a multiplier per layer: least energy within an accuracy budget (validation)", False),
    "bench": ("runner.bench", "time the LUT-MAC ops and whole models on each backend", True),
    "results": ("runner.results", "filter, pivot and plot results/results.csv", False),
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


def config_groups() -> dict[str, list[str]]:
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(CONFIG_DIR.iterdir()) if d.is_dir()}


def print_hydra_help(command: str) -> None:
    _, text, _ = COMMANDS[command]
    print(f"usage: approx-run {command} [key=value ...] [group=option ...] [-m]\n\n{text}\n")
    print(f"config: {CONFIG_DIR / (command + '.yaml')}\nconfig groups (choose with group=option):")
    for group, options in config_groups().items():
        print(f"  {group:<11} {', '.join(options)}")
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


def _validate_overrides(command: str, overrides: list[str]) -> None:
    """Compose once up front so a typo in an override is a clear exit-2 error rather than Hydra's exit 1."""
    from runner.config import compose

    compose(command, overrides)


def run_hydra_command(command: str, args: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    module = importlib.import_module(COMMANDS[command][0])
    multirun = any(a in ("-m", "--multirun") for a in args)
    hydra_flags = [a for a in args if a.startswith("-")]
    if not multirun and not hydra_flags:
        _validate_overrides(command, args)

    def task(cfg):
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        try:
            return module.run(cfg, out_dir)
        except UserError as exc:
            report_error(exc)
            sys.exit(exc.exit_code)

    sys.argv = [f"approx-run {command}", *args]
    hydra.main(config_path=str(CONFIG_DIR), config_name=command, version_base="1.3")(task)()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print_usage()
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"approx-run: unknown command '{command}'\n", file=sys.stderr)
        print_usage(sys.stderr)
        return 2
    module_name, _, is_hydra = COMMANDS[command]
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
    except KeyboardInterrupt:
        print("\ninterrupted: finished results are kept; rerun the same command to resume.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
