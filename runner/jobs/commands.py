"""The commands in words: what each does, which ones Hydra runs, which ones evaluate on a GPU; the usage
and per-command help printers. The modules behind the commands are named in runner.cli only."""
from __future__ import annotations

import sys

from runner.config import CONFIG_DIR

# command -> one-line help, in the order `approx-run --help` lists them
SUMMARIES = {
    "train": "train the fp32 baseline of any model (model=lenet5, resnet8, ..., custom); save its checkpoint",
    "compare": "accuracy/latency of pytorch fp32, fake-quant int8 and custom-MAC inference",
    "finetune": "compare, plus the approx model retrained through its LUT layers",
    "sweep": "run compare over many multipliers (Hydra multirun; resumable)",
    "sensitivity": "accuracy with one layer approximated at a time, per multiplier; heat map",
    "search": "a multiplier per layer: least energy within an accuracy budget (validation)",
    "bench": "time the LUT-MAC ops and whole models on each backend",
    "results": "filter, pivot and plot results/results.csv",
    "lut": "list, show and import multiplier look-up tables",
    "info": "versions, device, available backends, data sources",
}

# Commands run by hydra.main as one task (run(cfg, out_dir)); sweep, sensitivity and search compose their
# configs themselves (runner.jobs.hydra) and take Hydra overrides too; results, lut and info take flags.
HYDRA_COMMANDS = ("train", "compare", "finetune", "bench")
# the commands that evaluate models on the device their config names (bench times its own start-up)
GPU_COMMANDS = ("train", "compare", "finetune", "sweep", "sensitivity", "search")

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


def print_usage(stream=None) -> None:
    stream = sys.stdout if stream is None else stream
    print("usage: approx-run <command> [options | hydra overrides]\n\ncommands:", file=stream)
    for name, text in SUMMARIES.items():
        print(f"  {name:<11} {text}", file=stream)
    print("\n" + EXAMPLES, file=stream)


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
    print(f"usage: approx-run {command} [key=value ...] [group=option ...] [-m]\n\n{SUMMARIES[command]}\n")
    print(f"config: {CONFIG_DIR / (command + '.yaml')}\nconfig groups (choose with group=option):")
    for group, options in config_groups().items():
        print(f"  {group:<11} {', '.join(options)}")
    print()
    print_keys(command)
    print(f"\nshow the composed config: approx-run {command} --cfg job\n")
    print(EXAMPLES)


def print_command_help(command: str, doc: str, keys: str = "") -> None:
    """The help of a command with its own main() over a Hydra config: its module docstring's first paragraph,
    the config groups, its own keys."""
    print(doc.split("\n\n", 1)[0] + "\n")
    print_hydra_help(command)
    if keys:
        print(keys)
