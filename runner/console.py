"""Terminal output: rich tables and progress bars on a terminal, plain lines elsewhere (CI, logs)."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def is_interactive() -> bool:
    return sys.stdout.isatty()


@contextmanager
def progress_bar(description: str, total: int):
    """Yields advance(n=1, **info). Rich bar on a terminal; otherwise a line every ~10% of the work."""
    if is_interactive():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                      console=console, transient=False) as prog:
            task = prog.add_task(description, total=total, info="")

            def advance(n: int = 1, **info):
                prog.update(task, advance=n, info=" ".join(f"{k}={v}" for k, v in info.items()))

            yield advance
        return
    state = {"done": 0, "next": 0, "t0": time.perf_counter()}
    step = max(1, total // 10)

    def advance(n: int = 1, **info):
        state["done"] += n
        if state["done"] >= state["next"] or state["done"] == total:
            state["next"] = state["done"] + step
            extra = " ".join(f"{k}={v}" for k, v in info.items())
            print(f"{description}: {state['done']}/{total} ({time.perf_counter() - state['t0']:.1f}s) {extra}".rstrip(),
                  flush=True)

    yield advance
