"""Terminal output: rich tables and progress bars on a terminal, plain lines elsewhere (CI, logs), and
the one number format every table uses."""
from __future__ import annotations

import math
import numbers
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
    state = {"done": 0, "next": 0, "t0": time.perf_counter(), "first": None}
    step = max(1, total // 10)

    def advance(n: int = 1, **info):
        state["done"] += n
        elapsed = time.perf_counter() - state["t0"]
        if state["first"] is None:
            state["first"] = (state["done"], elapsed)
        if state["done"] >= state["next"] or state["done"] == total:
            state["next"] = state["done"] + step
            extra = " ".join(f"{k}={v}" for k, v in info.items())
            print(f"{description}: {state['done']}/{total} "
                  f"({elapsed:.1f}s{eta(elapsed, state['done'], total, state['first'])}) {extra}".rstrip(), flush=True)

    yield advance


def eta(elapsed: float, done: int, total: int, first: tuple[int, float] | None = None) -> str:
    """', about 12m left' from the mean time of the steps done so far ('' when none is done or all are).
    first: (steps, seconds) at the first advance; once more steps are done, the mean is of those after it,
    since the first step of a command carries its set-up (data, calibration: a minute on ImageNet, where an
    evaluation takes seconds) and would stretch every later estimate."""
    if done <= 0 or done >= total:
        return ""
    if first is not None and done > first[0]:
        left = (elapsed - first[1]) / (done - first[0]) * (total - done)
    else:
        left = elapsed / done * (total - done)
    return f", about {fmt_seconds(left)} left"


def fmt_seconds(s: float) -> str:
    return f"{s:.0f}s" if s < 90 else f"{s / 60:.0f}m" if s < 5400 else f"{s / 3600:.1f}h"


def fmt_number(v, digits: int = 4) -> str:
    """A cell for people: `digits` significant digits in fixed point (0.9712, 3.457, 0.001800); a float too
    large for any decimals rounded, with thousands separators (1,129 and 11,290, not 1.129e+04); an
    integer with thousands separators from 10,000 up (4096 stays as written); "" for a missing value."""
    if v is None or isinstance(v, str) or type(v).__name__ == "NAType":
        return v if isinstance(v, str) else ""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return str(bool(v))
    if isinstance(v, numbers.Integral):
        return f"{int(v):,}" if abs(int(v)) >= 10_000 else str(int(v))
    if not isinstance(v, numbers.Real):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return ""
    if math.isinf(v) or v == 0:
        return str(v) if v else "0"
    decimals = digits - 1 - math.floor(math.log10(abs(v)))
    if decimals <= 0:
        return f"{v:,.0f}"
    if decimals > digits + 4:  # below 1e-8 a fixed-point cell is all zeros
        return f"{v:.{digits - 1}e}"
    return f"{v:.{decimals}f}"


def _numeric_column(cells: list[str]) -> bool:
    filled = [c for c in cells if c]
    try:
        [float(c.replace(",", "")) for c in filled]
    except ValueError:
        return False
    return bool(filled)


def print_table(rows, title: str | None = None, *, columns=None, max_cell: int = 200) -> None:
    """Rows (a DataFrame or a list of dicts) as a rich table, numbers right-aligned in fmt_number's format.
    Piped output is not cut to 80 columns: a table in a log is read or grepped whole."""
    from rich.table import Table

    if hasattr(rows, "to_dict"):
        columns = list(columns or rows.columns)
        rows = rows.to_dict("records")
    columns = list(columns or (rows[0] if rows else []))
    out = console if is_interactive() else Console(width=max(80, 18 * len(columns)))
    table = Table(title=title)
    numeric = [_numeric_column([fmt_number(r.get(c)) for r in rows]) for c in columns]
    for c, num in zip(columns, numeric):
        table.add_column(str(c), overflow="fold", justify="right" if num else "left")
    for r in rows:
        table.add_row(*(fmt_number(r.get(c))[:max_cell] for c in columns))
    out.print(table)
