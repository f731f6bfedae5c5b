"""Reading, validating and writing 256x256 multiplier tables.

Formats (chosen by file name):
  .txt      ApproxTorch's text format: 256 lines of 256 whitespace-separated integers,
            row = operand A (activation), column = operand B (weight). Blank lines and lines
            starting with '#' are ignored.
  .txt.gz   the same, gzip-compressed.
  .npy      a 256x256 integer array (floats are accepted when every value is integral).

Layout check: some tools (TorchApprox, AdaPT) index signed tables by the raw byte of each
operand (index = code & 0xFF, so row 0 is A = 0 and row 128 is A = -128) instead of
offset-128 rows. A table is compared with the exact product under each convention and the
one it fits is reported; raw-byte tables are converted to our offset-128 layout.
"""

from __future__ import annotations

import gzip
import os
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import UserError
from .core import SIGNED_RANGE, SIZE, TWO16, Multiplier, value_range

SUFFIXES = (".txt", ".txt.gz", ".npy", ".h", ".bin", ".c", ".v")
TABLE_SUFFIXES = (".txt", ".txt.gz", ".npy")
# Widest range any 8x8 table may hold (signed int16 or unsigned uint16 products).
ANY_RANGE = (-(1 << 15), (1 << 16) - 1)
SIGNED_RANGE_MAX = SIGNED_RANGE[1]

LAYOUTS = {
    "offset128": "signed, offset-128 rows (A = row - 128, B = col - 128; ApproxTorch text layout)",
    "raw_bytes": "signed, raw two's-complement byte order (row = A & 0xFF, col = B & 0xFF; TorchApprox/AdaPT)",
    "unsigned": "unsigned (A = row, B = col)",
}


def table_suffix(path: Path) -> str:
    """The format suffix of a table or circuit file (.txt.gz counts as one), or a UserError naming the formats."""
    name = path.name.lower()
    for s in (".txt.gz",) + SUFFIXES:
        if name.endswith(s):
            return s
    raise UserError(f"{path}: unsupported table format; use a table ({', '.join(TABLE_SUFFIXES)}: 256 rows x 256 "
                    f"integers, row = activation A, column = weight B), a TFApprox .bin, a C header (.h) with a "
                    f"[256][256] array, or a circuit (.c C model, .v Verilog netlist)")


def stem(path: Path) -> str:
    return path.name[: -len(table_suffix(path))]


# ---------------------------------------------------------------- reading

def _read_text(path: Path, compressed: bool) -> str:
    try:
        if compressed:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
    except (OSError, EOFError, zlib.error) as e:
        if compressed and not isinstance(e, FileNotFoundError):
            raise UserError(f"{path}: not a readable gzip file ({e})") from None
        raise UserError(f"{path}: cannot read ({e})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (expected 256 lines of 256 integers)") from None


def _row_length_error(where: str, lineno: int, n_values: int, row: int) -> UserError:
    return UserError(f"{where}, line {lineno}: {n_values} values, expected 256 (row {row} of the table)")


def parse_text(text: str, where: str) -> tuple[np.ndarray, list[int]]:
    """Parse the text format; returns the int64 table and the file line of each row."""
    rows, lines = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if len(rows) == SIZE:
            raise UserError(f"{where}, line {lineno}: more than 256 rows (a table has 256 rows of 256 integers)")
        # a single-spaced row counts its values by its spaces, without building 256 strings (a sweep reads
        # every table); any other row is split. A row passing the quick count holds at most 256 values,
        # and the parse below checks that all rows together hold 256 x 256, so each holds exactly 256.
        if s.count(" ") != SIZE - 1 and len(tokens := s.split()) != SIZE:
            raise _row_length_error(where, lineno, len(tokens), len(rows))
        rows.append(s)
        lines.append(lineno)
    if not rows:
        raise UserError(f"{where}: empty file (expected 256 lines of 256 integers)")
    if len(rows) != SIZE:
        raise UserError(f"{where}: {len(rows)} rows, expected 256 (the file ends at line {lineno})")
    # numpy's C parser reads a whole table several times faster than converting token lists (a sweep reads
    # every shipped table). At a token it cannot read it stops (older numpy: a warning and a short result;
    # newer: ValueError), and it saturates on overflow; then the token-wise pass below names the culprit.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            flat = np.fromstring(" ".join(rows), dtype=np.int64, sep=" ")
    except (ValueError, DeprecationWarning):
        flat = np.zeros(0, dtype=np.int64)
    if flat.size == SIZE * SIZE and -(1 << 62) < flat.min() and flat.max() < 1 << 62:
        return flat.reshape(SIZE, SIZE), lines
    for i, (lineno, s) in enumerate(zip(lines, rows)):
        tokens = s.split()
        if len(tokens) != SIZE:  # a row the quick count let through
            raise _row_length_error(where, lineno, len(tokens), i)
        try:
            np.array(tokens, dtype=np.int64)
        except (ValueError, OverflowError):
            for col, tok in enumerate(tokens, start=1):
                try:
                    int(tok)
                except ValueError:
                    raise UserError(f"{where}, line {lineno}, column {col}: {tok!r} is not an integer") from None
            raise UserError(f"{where}, line {lineno}: value too large for a 16-bit product") from None
    raise UserError(f"{where}: holds values that are not plain decimal integers (ASCII digits, an optional sign)")


def _read_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001  (a damaged header reaches numpy's Python-literal parser, which
        # raises SyntaxError, tokenize.TokenError, ... besides the documented OSError/ValueError)
        raise UserError(f"{path}: not a readable .npy array ({type(e).__name__}: {e})") from None
    if arr.shape != (SIZE, SIZE):
        raise UserError(f"{path}: array shape {arr.shape}, expected (256, 256)")
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise UserError(f"{path}: element [{r}, {c}] = {float(arr[r, c])!r} is not an integer")
        if np.abs(arr).max() > ANY_RANGE[1]:
            r, c = np.unravel_index(np.abs(arr).argmax(), arr.shape)
            raise UserError(f"{path}: element [{r}, {c}] = {arr[r, c]:.0f} outside any 16-bit product range")
        return arr.astype(np.int64)
    raise UserError(f"{path}: array dtype {arr.dtype}, expected integers")


def read_values(path) -> tuple[np.ndarray, callable]:
    """Raw int64 [256, 256] values of a table file, plus a function naming the place of (row, col)."""
    path = Path(path)
    suffix = table_suffix(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if suffix == ".npy":
        values = _read_npy(path)
        return values, lambda r, c: f"{path}: element [{r}, {c}]"
    values, lines = parse_text(_read_text(path, suffix == ".txt.gz"), str(path))
    return values, lambda r, c: f"{path}, line {lines[r]}, column {c + 1}"


def check_range(values: np.ndarray, signed: bool | None, where) -> None:
    lo, hi = ANY_RANGE if signed is None else value_range(signed)
    bad = (values < lo) | (values > hi)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        kind = {None: "an 8x8", True: "a signed 8x8", False: "an unsigned 8x8"}[signed]
        raise UserError(f"{where(r, c)}: value {values[r, c]} outside the product range "
                        f"[{lo}, {hi}] of {kind} multiplier")


# ---------------------------------------------------------------- layout

def _layout_operands(layout: str) -> np.ndarray:
    idx = np.arange(SIZE, dtype=np.int64)
    if layout == "offset128":
        return idx - 128
    if layout == "raw_bytes":
        return np.where(idx < 128, idx, idx - 256)
    return idx


def raw_bytes_to_offset128(values: np.ndarray) -> np.ndarray:
    # Row r of the offset-128 table is A = r - 128, stored at raw row (r - 128) & 0xFF.
    return np.roll(values, (128, 128), axis=(0, 1))


@dataclass
class LayoutReport:
    layout: str                 # the convention the table was read with
    signed: bool
    exact: bool                 # reproduces a*b exactly in that convention
    mae: dict                   # mean |table - a*b| under each convention
    converted: bool             # raw-byte order was converted to offset-128
    symmetric: bool = False     # equal to its transpose: the operand order cannot matter
    signed_from: str = ""       # how signedness was decided when the values did not decide it

    @property
    def note(self) -> str:
        s = f"layout: {LAYOUTS[self.layout]}"
        if self.signed_from:
            s += f"; {self.signed_from}"
        if self.converted:
            s += "; converted to offset-128 rows"
        if self.exact:
            s += "; exact (reproduces a*b)"
        if self.symmetric:
            s += "; symmetric (A*B = B*A for every pair, so --transpose changes nothing)"
        return s


# A table decides its signedness when its best fit under one convention is at least this many times
# closer to a*b (relative to an all-zero table's distance) than under the other; a real multiplier
# fits its own convention an order of magnitude better, a constant table fits neither.
_DECISIVE = 2.0


def signed_by_name(names) -> bool | None:
    """EvoApproxLib's file-name convention: mul8u_* unsigned, mul8s_* signed."""
    for n in names:
        base = Path(str(n)).name.lower()
        if base.startswith("mul8u_"):
            return False
        if base.startswith("mul8s_"):
            return True
    return None


def infer_signed(values: np.ndarray, mae: dict, zero: dict, where: str, names=()) -> tuple[bool, str]:
    """Signedness of a table nobody declared: from the value range (a negative product is signed, one
    above 32767 unsigned), else from which convention the values fit clearly better, else from the file
    name; otherwise UserError. Returns (signed, how it was decided when not by the values)."""
    if values.min() < 0:
        return True, ""
    if values.max() > SIGNED_RANGE_MAX:
        return False, ""
    fit_signed = min(mae[k] / zero[k] for k in ("offset128", "raw_bytes"))
    fit_unsigned = mae["unsigned"] / zero["unsigned"]
    if fit_signed * _DECISIVE <= fit_unsigned:
        return True, ""
    if fit_unsigned * _DECISIVE <= fit_signed:
        return False, ""
    by_name = signed_by_name(names)
    if by_name is not None:
        kind = "signed (mul8s_*)" if by_name else "unsigned (mul8u_*)"
        return by_name, f"the values fit a signed and an unsigned multiplier alike; read as {kind} from the file name"
    raise UserError(f"{where}: the values fit a signed and an unsigned multiplier alike (every value in 0..32767 "
                    f"and neither layout fits clearly better), so the layout cannot be told from them. Say which: "
                    f"`--signed` or `--unsigned` (lut import), multiplier.signed=true|false (config), or name the file "
                    f"mul8s_*/mul8u_* as EvoApproxLib does")


def check_layout(values: np.ndarray, signed: bool | None, where: str, *, expect_exact: bool = False,
                 layout: str = "auto", names=()) -> LayoutReport:
    """Decide which index convention a table uses; raise UserError where it contradicts the claim or
    where nothing (values, claim, file name) decides it."""
    mae, zero = {}, {}
    for name in LAYOUTS:
        a = _layout_operands(name)
        exact = np.outer(a, a)
        mae[name] = float(np.abs(values - exact).mean())
        zero[name] = float(np.abs(exact).mean())
    signed_from, declared = "", signed is not None
    if signed is None and layout == "auto":
        signed, signed_from = infer_signed(values, mae, zero, where, names)
    allowed = {None: list(LAYOUTS), True: ["offset128", "raw_bytes"], False: ["unsigned"]}[signed]
    if layout != "auto":
        if layout not in LAYOUTS:
            raise UserError(f"unknown layout {layout!r}; use one of auto, {', '.join(LAYOUTS)}")
        if layout not in allowed:
            raise UserError(f"{where}: layout {layout} contradicts "
                            f"{'--signed' if signed else '--unsigned'}")
        chosen = layout
    else:
        chosen = min(allowed, key=lambda k: mae[k])  # dict order prefers offset128 on ties
        # compared relative to an all-zero table's distance, which differs between the conventions
        fit = {k: mae[k] / zero[k] for k in LAYOUTS}
        best = min(LAYOUTS, key=lambda k: fit[k])
        if declared and best not in allowed and fit[best] * _DECISIVE <= fit[chosen]:
            flag = "--unsigned" if best == "unsigned" else "--signed"
            raise UserError(f"{where}: declared {'signed' if signed else 'unsigned'}, but the table fits "
                            f"the {LAYOUTS[best]} layout (mean |error| {mae[best]:.1f} vs {mae[chosen]:.1f}); "
                            f"use {flag}")
    fmt = ", ".join(f"{k} {v / TWO16 * 100:.3g}%" for k, v in mae.items())
    report = LayoutReport(chosen, chosen != "unsigned", mae[chosen] == 0.0, mae, chosen == "raw_bytes",
                          symmetric=bool(np.array_equal(values, values.T)), signed_from=signed_from)
    if expect_exact and not report.exact:
        exact_in = [k for k, v in mae.items() if v == 0.0]
        hint = (f"it is exact in the {LAYOUTS[exact_in[0]]} layout" if exact_in
                else f"it is exact in no known layout (MAE% under each layout: {fmt})")
        raise UserError(f"{where}: claims to be exact but does not reproduce a*b in the "
                        f"{LAYOUTS[chosen]} layout; {hint}")
    # A table further from a*b than an all-zero table is no multiplier in that layout.
    if mae[chosen] > zero[chosen]:
        fits = [k for k in LAYOUTS if mae[k] <= zero[k]]
        if fits:
            raise UserError(f"{where}: does not fit the {LAYOUTS[chosen]} layout, but fits the "
                            f"{LAYOUTS[fits[0]]} layout (MAE% under each layout: {fmt})")
        raise UserError(f"{where}: the table matches none of the known layouts (it is further from a*b than "
                        f"an all-zero table; MAE% under each layout: {fmt}). Check that rows are operand A "
                        f"and columns operand B, and that the file holds products")
    return report


# ---------------------------------------------------------------- public API

def save_table(m: Multiplier, path) -> Path:
    """Write m.lut in the format named by the file's suffix (.txt, .txt.gz, .npy)."""
    path = Path(path)
    suffix = table_suffix(path)
    if suffix not in TABLE_SUFFIXES:
        raise UserError(f"{path}: tables are saved as {', '.join(TABLE_SUFFIXES)}; `lut export` writes the other formats")
    path.parent.mkdir(parents=True, exist_ok=True)
    values = m.lut.numpy()
    if suffix == ".npy":
        with open(path, "wb") as f:  # np.save(path) would append .npy to a missing suffix
            np.save(f, values.astype(np.int32))
        return path
    text = "\n".join(" ".join(map(str, row)) for row in values.tolist()) + "\n"
    if suffix == ".txt.gz":
        # mtime=0 keeps the compressed bytes reproducible.
        with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
            f.write(text.encode())
    else:
        path.write_text(text)
    return path
