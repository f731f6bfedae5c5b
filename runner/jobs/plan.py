"""A job as data: what one evaluation will record (Plan), a job with its config and run dir (Job), the
multiplier config node of a name or a table file, and where a command's run directory goes."""
from __future__ import annotations

import dataclasses
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import UserError
from runner.jobs.argv import is_table_path

if TYPE_CHECKING:  # omegaconf is imported where it is used: `approx-run info` and `lut` start without it
    from omegaconf import DictConfig


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a compare run will do, known before it runs (runner.compare.plan_run): sweeps group jobs that
    share reference rows by it and find each job's rows afterwards by its row keys."""
    device: Any  # torch.device: the evaluation device
    approx_layers: list[str]  # the layers whose multiplies go through the table
    multipliers: dict  # layer name -> Multiplier, every quantized layer
    row_keys: dict[str, str]  # path (pytorch, fakequant, approx[, approx_finetuned]) -> its results row key

    def on(self, device) -> "Plan":
        """The same plan on another device (a job may run on a different leased GPU than it was planned on)."""
        return dataclasses.replace(self, device=device)


@dataclasses.dataclass
class Job:
    """One evaluation of a command that runs many: its overrides (how a user would ask for it alone), its
    composed config, its run dir and its plan (None when it cannot run: plan_error says why, and the job
    itself records the failure when it runs)."""
    num: int
    overrides: list[str]
    cfg: DictConfig
    out_dir: Path
    plan: Plan | None = None
    plan_error: str = ""
    label: dict = dataclasses.field(default_factory=dict)  # shown beside the progress bar


def multiplier_node(spec: str, layers: dict | None = None) -> dict:
    """The multiplier config node of a registered name or a table file; layers: per-layer overrides kept."""
    node = {"name": "file", "path": spec, "signed": None} if is_table_path(spec) else {"name": spec}
    if layers:
        node["layers"] = layers
    return node


def with_multiplier(cfg: DictConfig) -> DictConfig:
    """The compare config of a sweep job: sweep.multiplier (a name or a table file) replaces the multiplier
    group, keeping its per-layer overrides."""
    from omegaconf import OmegaConf, open_dict

    spec = cfg.get("sweep", {}).get("multiplier")
    if spec in (None, ""):
        return cfg
    layers = cfg.multiplier.get("layers")
    node = multiplier_node(str(spec), OmegaConf.to_container(layers, resolve=True) if layers else None)
    with open_dict(cfg):
        cfg.multiplier = OmegaConf.create(node)
    return cfg


def run_dir(cfg: DictConfig, command: str | None = None) -> Path:
    """<paths.results>/<command>/<date>_<time>: where a command's outputs go, as configs/common.yaml names
    Hydra's run and sweep dirs (for the commands that compose their configs themselves)."""
    return Path(cfg.paths.results) / str(command or cfg.command) / time.strftime("%Y-%m-%d_%H-%M-%S")


def make_run_dir(cfg: DictConfig) -> Path:
    """A new run dir with the composed config in it."""
    from runner.provenance import write_config_yaml

    path = run_dir(cfg)
    path.mkdir(parents=True, exist_ok=True)
    write_config_yaml(path / "config.yaml", cfg)
    return path


# what a command writes into its run dir on the way in, before any result: its config, Hydra's .hydra/ records
# and its (empty) log
BOOKKEEPING = ("config.yaml", "hydra.yaml", "overrides.yaml")


def remove_if_bare(path: Path, root: Path) -> bool:
    """Remove a run dir that holds nothing but BOOKKEEPING and logs, then its parents up to root while they are
    empty (results/compare/ after results/compare/<date>_<time>/): a command that stops with a user error
    leaves nothing behind. True when removed; a dir with any result in it stays."""
    path = Path(path)
    if not path.is_dir():
        return False
    if any(p.name not in BOOKKEEPING and p.suffix != ".log" for p in path.rglob("*") if not p.is_dir()):
        return False
    shutil.rmtree(path, ignore_errors=True)
    root, parent = Path(root).resolve(), path.resolve().parent
    while parent != root and root in parent.parents:
        try:
            parent.rmdir()
        except OSError:  # not empty: another run's dir is in it
            break
        parent = parent.parent
    return True


@contextmanager
def removed_on_user_error(path: Path, root: Path):
    """The run dir `path` removed (remove_if_bare) when the block stops with a UserError before writing a result."""
    try:
        yield
    except UserError:
        remove_if_bare(path, root)
        raise
