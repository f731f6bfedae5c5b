"""Result tables: tidy rows with unit-suffixed columns, appended to a cumulative CSV under a file
lock (parallel sweep jobs never interleave or lose rows), plus `approx-run results`."""
from __future__ import annotations

import fcntl
import io
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from runner.errors import UserError
from runner.provenance import atomic_write_bytes


@contextmanager
def locked(path: Path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_csv(path: Path) -> pd.DataFrame:
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    try:
        return pd.read_csv(path)
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a readable results CSV ({exc}).") from exc


def write_csv(path: Path, df: pd.DataFrame) -> None:
    buf = io.StringIO()
    df.to_csv(buf, index=False)
    atomic_write_bytes(Path(path), buf.getvalue().encode())


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append under an exclusive lock; the file is rewritten atomically, so a crash mid-write leaves the
    previous version, and new columns widen the table instead of shifting values."""
    if not rows:
        return
    with locked(path):
        old = read_csv(path)
        new = pd.DataFrame(rows)
        write_csv(path, new if old.empty else pd.concat([old, new], ignore_index=True, sort=False))


def done_keys(path: Path, column: str = "row_key") -> set[str]:
    df = read_csv(path)
    if df.empty or column not in df or "status" not in df:
        return set()
    return set(df.loc[df["status"] == "ok", column].astype(str))
