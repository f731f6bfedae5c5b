"""The table files of other approximate-computing tools, read and written.

  .bin  TFApprox: 65,536 little-endian uint16, entry a*256 + b for operand codes a (activation) and
        b (weight), i.e. unsigned layout; a signed product is stored as its 16-bit two's-complement
        pattern at the operands' raw byte codes (a & 0xFF), which is how a uint16 table of a signed
        multiplier is indexed. Signedness is not in the file: --signed/--unsigned, the name, or the
        values decide (circuits.decide_signed).
  .h    AdaPT / TransAxx: a C header holding one `TYPE NAME[256][256] = {{...}, ...};` array. We
        write signed tables as int16_t in raw byte order (index [(uint8_t)a][(uint8_t)b], how those
        tools index them) and unsigned ones as uint16_t; on reading, the layout is detected like a
        text table's (offset-128 rows or raw byte order).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..provenance import atomic_write_bytes
from .circuits import CIRCUIT_SUFFIXES, Loaded, as_values, decide_signed, finish, load_circuit, read_source
from .core import SIZE, Multiplier
from .io import (check_layout, check_range, raw_bytes_to_offset128, read_values, save_table, signed_by_name, stem,
                 table_suffix)

BIN_BYTES = SIZE * SIZE * 2
EXPORT_FORMATS = ("txt", "npy", "bin", "h")
_ARRAY = re.compile(r"([A-Za-z_][A-Za-z_0-9 \t]*?)\b([A-Za-z_][A-Za-z_0-9]*)\s*((?:\[\s*[^\]]*\]\s*)+)=\s*\{")
_NUMBER = re.compile(r"[-+]?\s*(?:0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*")


def load_bin(path: Path, signed: bool | None, *, name: str = "", expect_exact: bool = False,
             transpose: bool = False) -> Loaded:
    start = time.perf_counter()
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    size = path.stat().st_size
    if size != BIN_BYTES:
        raise UserError(f"{path}: {size:,} bytes; a TFApprox table holds 65,536 little-endian uint16 "
                        f"({BIN_BYTES:,} bytes)")
    pattern = np.frombuffer(path.read_bytes(), dtype="<u2").reshape(SIZE, SIZE).astype(np.int64)
    if transpose:
        pattern = pattern.T.copy()
    names = (path.name, name)
    s, why = decide_signed(pattern, signed, (None, ""), str(path), names)
    loaded = finish(as_values(pattern, s), s, str(path), [why], expect_exact, names)
    loaded.seconds = time.perf_counter() - start
    return loaded


def _c_int(tok: str) -> int:
    t = re.sub(r"\s+", "", tok).rstrip("uUlL")
    neg = t.startswith("-")
    t = t.lstrip("+-")
    v = int(t, 16) if t[:2].lower() == "0x" else int(t, 8) if len(t) > 1 and t.startswith("0") else int(t)
    return -v if neg else v


def read_header(path: Path) -> tuple[np.ndarray, bool]:
    """(int64 [256, 256] values as written, element type is unsigned 16-bit) of a C header's table."""
    text = read_source(path)
    code = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    code = re.sub(r"//[^\n]*", "", code)
    arrays = [m for m in _ARRAY.finditer(code) if "[" in m.group(3)]
    if not arrays:
        raise UserError(f"{path}: no array initialiser found (expected `int16_t NAME[256][256] = {{...}};`)")
    if len(arrays) > 1:
        raise UserError(f"{path}: {len(arrays)} arrays; a table header holds one [256][256] array")
    m = arrays[0]
    line = code.count("\n", 0, m.start()) + 1
    dims = re.findall(r"\[\s*([^\]]*)\]", m.group(3))
    if dims != ["256", "256"]:
        raise UserError(f"{path}:{line}: array {m.group(2)} has shape [{']['.join(dims)}], expected [256][256]")
    depth, rows, row = 1, [], None
    for tok in re.finditer(r"\{|\}|,|" + _NUMBER.pattern + r"|\S", code[m.end():]):
        s = tok.group()
        if s == "{":
            depth += 1
            if depth > 2:
                raise UserError(f"{path}: braces nested deeper than a [256][256] array")
            row = []
        elif s == "}":
            depth -= 1
            if depth == 1:
                rows.append(row)
            if depth == 0:
                break
        elif s == ",":
            continue
        elif _NUMBER.fullmatch(s):
            if depth != 2:
                raise UserError(f"{path}: values outside the row braces (expected {{{{...}}, {{...}}, ...}})")
            row.append(_c_int(s))
        else:
            l_ = code.count("\n", 0, m.end() + tok.start()) + 1
            raise UserError(f"{path}:{l_}: {s!r} is not an integer (a table header holds integer constants only)")
    else:
        raise UserError(f"{path}: the array is not closed (is the file truncated?)")
    if len(rows) != SIZE or any(len(r) != SIZE for r in rows):
        bad = next((i for i, r in enumerate(rows) if len(r) != SIZE), None)
        shape = f"{len(rows)} rows" if len(rows) != SIZE else f"row {bad} has {len(rows[bad])} values"
        raise UserError(f"{path}:{line}: the initialiser has {shape}, expected 256 rows of 256 values")
    words = m.group(1).split()
    unsigned16 = "uint16_t" in words or ("unsigned" in words and "short" in words)
    return np.array(rows, dtype=np.int64), unsigned16


def load_file(path: Path, signed: bool | None = None, *, layout: str = "auto", transpose: bool = False,
              activation: str | None = None, name: str = "", expect_exact: bool = False) -> Loaded:
    """Any supported file as a validated table in our layout (io.SUFFIXES)."""
    path = Path(path)
    suffix = table_suffix(path)
    if activation and suffix not in CIRCUIT_SUFFIXES:
        raise UserError(f"--activation-operand applies to circuits (.c, .v); for a table file, --transpose "
                        f"swaps the operands")
    if suffix in CIRCUIT_SUFFIXES:
        if transpose:
            raise UserError("--transpose applies to table files; for a circuit, say which operand is the "
                            "activation with --activation-operand NAME")
        if layout != "auto":
            raise UserError("--layout applies to table files; a circuit's layout follows from its signedness")
        return load_circuit(path, signed, activation=activation, name=name, expect_exact=expect_exact)
    if suffix == ".bin":
        if layout != "auto":
            raise UserError("--layout applies to text, .npy and .h tables; a .bin is indexed by operand codes")
        return load_bin(path, signed, name=name, expect_exact=expect_exact, transpose=transpose)
    start = time.perf_counter()
    notes = []
    if suffix == ".h":
        values, unsigned16 = read_header(path)
        where = lambda r, c: f"{path}: element [{r}][{c}]"  # noqa: E731
        wants_signed = signed if signed is not None else signed_by_name((path.name, name))
        if unsigned16 and wants_signed and values.max() > 32767:
            values = values.astype(np.uint16).view(np.int16).astype(np.int64)
            notes.append("uint16_t elements read as two's-complement int16 products")
    else:
        values, where = read_values(path)
    check_range(values, None, where)
    if transpose:
        values = values.T.copy()
    report = check_layout(values, signed, str(path), expect_exact=expect_exact, layout=layout, names=(path.name, name))
    check_range(values, report.signed, where)
    if report.converted:
        values = raw_bytes_to_offset128(values)
    return Loaded(values, report.signed, report.layout, report.note, notes, seconds=time.perf_counter() - start)


# ---------------------------------------------------------------- export

def _c_name(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return s if re.match(r"[A-Za-z_]", s) else f"lut_{s}"


def header_text(m: Multiplier) -> str:
    values = m.lut.numpy().astype(np.int64)
    if m.signed:
        values = raw_bytes_to_offset128(values)     # back to raw byte order: the roll is its own inverse
    ctype = "int16_t" if m.signed else "uint16_t"
    index = "[(uint8_t)a][(uint8_t)b] (raw two's-complement byte codes)" if m.signed else "[a][b]"
    rows = ",\n".join("  {" + ", ".join(map(str, r)) + "}" for r in values.tolist())
    return (f"/* {m.name}: approximate 8x8 {'signed' if m.signed else 'unsigned'} multiplier, written by approx-run.\n"
            f" * product(a, b) = {_c_name(m.name)}{index}; a = activation, b = weight.\n"
            f" * sha256 (approx-run table hash): {m.sha256} */\n"
            f"#include <stdint.h>\n\nstatic const {ctype} {_c_name(m.name)}[256][256] = {{\n{rows}\n}};\n")


def export(m: Multiplier, fmt: str, path: Path) -> Path:
    """Write m in one of EXPORT_FORMATS; txt may be gzipped by naming the file .txt.gz."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"unknown export format {fmt!r}; use one of {', '.join(EXPORT_FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt in ("txt", "npy"):
        want = (".txt", ".txt.gz") if fmt == "txt" else (".npy",)
        if not path.name.lower().endswith(want):
            raise UserError(f"{path}: a {fmt} export's file name ends in {' or '.join(want)}")
        tmp = path.with_name(f".{path.name}.tmp{path.name[path.name.find('.'):]}")
        save_table(m, tmp)
        tmp.replace(path)
        return path
    if fmt == "bin":
        values = m.lut.numpy().astype(np.int64)
        if m.signed:
            values = raw_bytes_to_offset128(values)
        data = (values & 0xFFFF).astype("<u2").tobytes()
    else:
        data = header_text(m).encode()
    atomic_write_bytes(path, data)
    os.chmod(path, 0o644)       # the temporary file's 0600 would keep the other tool's user out
    return path


def load_table(path, signed: bool | None = None, *, name: str | None = None, layout: str = "auto",
               expect_exact: bool | None = None, activation: str | None = None) -> Multiplier:
    """Load and validate a table or circuit file (any of SUFFIXES).

    signed=None infers signedness (see load_file). expect_exact=None treats a
    file whose name contains "exact" as claiming exactness. The result is always in our
    offset-128 (signed) or plain (unsigned) layout."""
    path = Path(os.path.expanduser(str(path)))
    if expect_exact is None:
        expect_exact = "exact" in path.name.lower()
    loaded = load_file(path, signed, layout=layout, activation=activation, name=name or "", expect_exact=expect_exact)
    return Multiplier(
        name=name or stem(path),
        signed=loaded.signed,
        lut=loaded.values.astype(np.int32),
        source=f"file:{path.resolve()}",
        published=loaded.published,
        params={"path": str(path.resolve()), "layout": loaded.layout, "layout_note": loaded.layout_note,
                **({"notes": loaded.notes} if loaded.notes else {})},
    )
