"""The cumulative results CSV: tidy rows with unit-suffixed columns, appended under a file lock so
parallel sweep jobs never interleave or lose rows, and checked on every read so that a damaged file
is reported (and never rewritten with fewer rows) instead of being silently misread."""
from __future__ import annotations

import csv
import functools
import io
import math
import numbers
from contextlib import contextmanager
from pathlib import Path

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

# What a row's numbers are of (its `scope` column; runner.compare.scope_of decides, runner.report infers it for
# rows written before the column existed).
SCOPES = ("network", "layer", "assignment", "finetuned", "reference")


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


def _table(path: Path, text: str) -> tuple[list[str], list[list[str]]]:
    """(header, records) of a whole CSV table; UserError when the text is not one: a last line cut off
    (the writer died or the copy stopped) or a row whose field count differs from the header's (rows of
    another version appended without rewriting the header), which pandas would silently pad or misalign."""
    if text and not text.endswith("\n"):
        last = text.rsplit("\n", 1)[-1]
        raise _damaged(path, f"its last line is cut off ({last[:60]!r} has no line end)")
    try:
        records = csv.reader(io.StringIO(text), strict=True)
        header = next(records, [])
        body = []
        for number, record in enumerate(records, start=2):
            if not record:  # blank lines are skipped, as pandas does
                continue
            if len(record) != len(header):
                raise _damaged(path, f"record {number} has {len(record)} fields where the header has "
                                     f"{len(header)} (rows written with other columns)")
            body.append(record)
    except csv.Error as exc:
        raise _damaged(path, f"not valid CSV ({exc})") from None
    return header, body


def _identity(path: Path):
    """(resolved path, inode, mtime, size) of an existing non-empty file, else None. Writers replace the
    file (a new inode), so a parse cached under an identity cannot go stale."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (str(path.resolve()), st.st_ino, st.st_mtime_ns, st.st_size) if st.st_size else None


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not a results CSV (not text: {exc}).") from None


# A sweep reads its results file before and after every job; parsing the growing file each time cost
# more than the jobs' evaluation.
@functools.lru_cache(maxsize=8)
def _records(path: str, inode: int, mtime_ns: int, size: int) -> tuple[list[str], list[list[str]], str]:
    text = _read_text(path)
    return (*_table(Path(path), text), text)


@functools.lru_cache(maxsize=8)
def _frame(path: str, inode: int, mtime_ns: int, size: int):
    import pandas as pd

    text = _records(path, inode, mtime_ns, size)[2]
    try:
        # keys stay text: a key of digits alone ("0123...") would otherwise become a number and lose its zeros
        return pd.read_csv(io.StringIO(text), low_memory=False, dtype={c: str for c in KEY_COLUMNS})
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise _damaged(Path(path), f"pandas cannot parse it ({exc})") from None


def read_csv(path: Path):
    """The rows of a results CSV as a DataFrame (empty for a missing or empty file); UserError when damaged."""
    ident = _identity(Path(path))
    if ident is None:
        import pandas as pd

        return pd.DataFrame()
    return _frame(*ident).copy()


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a results CSV as they are written (strings, "" where empty), without pandas: the
    commands that only look rows up by key start faster."""
    ident = _identity(Path(path))
    if ident is None:
        return []
    header, records, _ = _records(*ident)
    return [dict(zip(header, r)) for r in records]


def _store_table(path: Path) -> tuple[list[str], list[list[str]], str]:
    """(header, records, text) of a results file, checked whole and for the store's own columns: a file
    of an older version without them would make every row look undone."""
    ident = _identity(Path(path))
    if ident is None:
        return [], [], ""
    header, records, text = _records(*ident)
    missing = [c for c in KEY_COLUMNS if c not in header]
    if missing:
        raise UserError(f"{path} has no {' / '.join(missing)} column: it was written by an older approx-run or "
                        f"by hand, so a rerun cannot tell which rows are done. Nothing was written to it. Fix: "
                        f"move it aside (`mv {path} {path}.old`) and rerun; `approx-run results {path}.old` "
                        "still reads it.")
    return header, records, text


def check_store(path: Path) -> None:
    """UserError when `path` cannot be appended to (damaged, or without the store's columns)."""
    _store_table(path)


def _cell(value) -> str:
    """A value as pandas' to_csv writes it: "" for None and NaN, shortest round-trip text for floats."""
    if value is None:
        return ""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) and math.isnan(value):
        return ""
    return str(value)


def _csv_text(records) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(records)
    return buf.getvalue()


def _columns(rows: list[dict], start: list[str] = ()) -> list[str]:
    """`start`, then every other key of the rows in order of first appearance (pandas' column order)."""
    return list(dict.fromkeys([*start, *(k for r in rows for k in r)]))


def _records_of(rows: list[dict], columns: list[str]) -> list[list[str]]:
    return [[_cell(r.get(c)) for c in columns] for r in rows]


def write_csv(path: Path, table) -> None:
    """A DataFrame, or a list of row dicts (columns in order of first appearance), written atomically."""
    if hasattr(table, "to_csv"):
        buf = io.StringIO()
        table.to_csv(buf, index=False)
        text = buf.getvalue()
    else:
        header = _columns(table)
        text = _csv_text([header, *_records_of(table, header)])
    atomic_write_bytes(Path(path), text.encode())


def _ok_keys(header: list[str], records: list[list[str]], column: str = "row_key") -> set[str]:
    if column not in header or "status" not in header:
        return set()
    k, s = header.index(column), header.index("status")
    return {r[k] for r in records if r[s] == "ok"}


def done_keys(path: Path, column: str = "row_key") -> set[str]:
    """Keys of the rows recorded ok."""
    header, records, _ = _store_table(path)
    return _ok_keys(header, records, column)


def append_rows(path: Path, rows: list[dict], *, skip_recorded: bool = False, column: str = "row_key") -> list[dict]:
    """Append under an exclusive lock; the file is rewritten atomically, so a crash mid-write leaves the
    previous version, and new columns widen the table instead of shifting values. With skip_recorded,
    rows whose key is already recorded ok are dropped (checked under the lock, so two sweeps racing on
    the same job record it once); failed rows are always kept. Returns the rows added. A damaged file
    raises UserError and is left as it is."""
    if not rows:
        return []
    with locked(path):
        header, records, text = _store_table(path)
        if skip_recorded:
            done = _ok_keys(header, records, column)
            rows = [r for r in rows if r.get("status") != "ok" or str(r.get(column)) not in done]
        if rows:
            columns = _columns(rows, header)
            new = _records_of(rows, columns)
            if columns == header:  # the common case: the old text stays as it is
                text += _csv_text(new)
            else:  # new columns: every row widens, old ones empty in them
                pad = [""] * (len(columns) - len(header))
                text = _csv_text([columns, *(r + pad for r in records), *new])
            atomic_write_bytes(Path(path), text.encode())
        return rows
