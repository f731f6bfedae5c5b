"""The cumulative results CSV: tidy rows with unit-suffixed columns, appended under a file lock so
parallel sweep jobs never interleave or lose rows, and checked on every read so that a damaged file
is reported (and never rewritten with fewer rows) instead of being silently misread."""
from __future__ import annotations

import csv
import functools
import io
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
from filelock import FileLock, Timeout

from runner.console import console
from runner.errors import UserError
from runner.provenance import atomic_write_bytes

# Appending rewrites a file of at most a few thousand rows (well under a second), so a lock held
# for minutes is a hung holder or a file system without working locks, not a busy neighbour.
LOCK_TIMEOUT_S = 600.0

# The columns resume depends on: without them a rerun cannot tell which rows are done and would
# append every row again.
KEY_COLUMNS = ("row_key", "status")


@contextmanager
def locked(path: Path, timeout: float | None = LOCK_TIMEOUT_S, waiting: str | None = None):
    """Exclusive lock on <path>.lock, a sibling file that stays (removing it would let two holders in).
    timeout=None waits as long as the holder needs; `waiting` is printed once when another holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path.with_name(path.name + ".lock")))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if waiting:
                console.print(f"[yellow]waiting[/]: {waiting} ({lock.lock_file} is held)", highlight=False)
            lock.acquire(timeout=-1 if timeout is None else timeout)
    except Timeout:
        raise UserError(f"could not lock {path} within {timeout:.0f} s: another approx-run holds {lock.lock_file}, "
                        "or the file system does not support locks (see docs/reliability.md).") from None
    except NotImplementedError:  # older filelock versions, where flock(2) answers ENOSYS
        raise UserError(f"the file system of {path} does not support flock(2), which keeps parallel runs from "
                        "losing rows; put paths.results and paths.checkpoints on one that does "
                        "(see docs/reliability.md).") from None
    try:
        yield
    finally:
        lock.release()


def _damaged(path: Path, why: str) -> UserError:
    return UserError(f"{path} is damaged: {why}. Nothing was written to it. Fix: move it aside "
                     f"(`mv {path} {path}.damaged`) and rerun to start a new file (the rows it holds can be "
                     f"read with a spreadsheet or `approx-run results {path}.damaged` once repaired), "
                     "or repair that line by hand.")


def check_csv(path: Path, text: str) -> None:
    """Raise UserError when the text is not a whole CSV table: a last line cut off (the writer died or
    the copy stopped) or a row whose field count differs from the header's (rows of another version
    appended without rewriting the header), which pandas would silently pad or misalign."""
    if not text.endswith("\n"):
        last = text.rsplit("\n", 1)[-1]
        raise _damaged(path, f"its last line is cut off ({last[:60]!r} has no line end)")
    try:
        records = csv.reader(io.StringIO(text), strict=True)
        header = next(records, [])
        for number, record in enumerate(records, start=2):
            if record and len(record) != len(header):   # blank lines are skipped, as pandas does
                raise _damaged(path, f"record {number} has {len(record)} fields where the header has "
                                     f"{len(header)} (rows written with other columns)")
    except csv.Error as exc:
        raise _damaged(path, f"not valid CSV ({exc})") from None


def read_csv(path: Path) -> pd.DataFrame:
    """The rows of a results CSV (empty frame for a missing or empty file); UserError when damaged."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return pd.DataFrame()
    if st.st_size == 0:
        return pd.DataFrame()
    return _parse(str(path.resolve()), st.st_ino, st.st_mtime_ns, st.st_size).copy()


# Keyed by the file's identity: a sweep reads its results file before and after every job, and parsing
# the growing file each time cost more than the jobs' evaluation. Writers replace the file (a new inode),
# so a stale parse cannot match.
@functools.lru_cache(maxsize=8)
def _parse(path: str, inode: int, mtime_ns: int, size: int) -> pd.DataFrame:
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not a results CSV (not text: {exc}).") from None
    check_csv(Path(path), text)
    try:
        return pd.read_csv(io.StringIO(text), low_memory=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise _damaged(Path(path), f"pandas cannot parse it ({exc})") from None


def read_store(path: Path) -> pd.DataFrame:
    """read_csv, and the store's own columns present: a file of an older version without them would
    make every row look undone."""
    df = read_csv(path)
    missing = [c for c in KEY_COLUMNS if not df.empty and c not in df]
    if missing:
        raise UserError(f"{path} has no {' / '.join(missing)} column: it was written by an older approx-run or "
                        f"by hand, so a rerun cannot tell which rows are done. Nothing was written to it. Fix: "
                        f"move it aside (`mv {path} {path}.old`) and rerun; `approx-run results {path}.old` "
                        "still reads it.")
    return df


def write_csv(path: Path, df: pd.DataFrame) -> None:
    buf = io.StringIO()
    df.to_csv(buf, index=False)
    atomic_write_bytes(Path(path), buf.getvalue().encode())


def _ok_keys(df: pd.DataFrame, column: str = "row_key") -> set[str]:
    if df.empty or column not in df or "status" not in df:
        return set()
    return set(df.loc[df["status"] == "ok", column].astype(str))


def done_keys(path: Path, column: str = "row_key") -> set[str]:
    """Keys of the rows recorded ok."""
    return _ok_keys(read_store(path), column)


def append_rows(path: Path, rows: list[dict], *, skip_recorded: bool = False, column: str = "row_key") -> list[dict]:
    """Append under an exclusive lock; the file is rewritten atomically, so a crash mid-write leaves the
    previous version, and new columns widen the table instead of shifting values. With skip_recorded,
    rows whose key is already recorded ok are dropped (checked under the lock, so two sweeps racing on
    the same job record it once); failed rows are always kept. Returns the rows added. A damaged file
    raises UserError and is left as it is."""
    if not rows:
        return []
    with locked(path):
        old = read_store(path)
        if skip_recorded:
            done = _ok_keys(old, column)
            rows = [r for r in rows if r.get("status") != "ok" or str(r.get(column)) not in done]
        if rows:
            new = pd.DataFrame(rows)
            write_csv(path, new if old.empty else pd.concat([old, new], ignore_index=True, sort=False))
        return rows
