"""Tables from what researchers download: a circuit's C model or Verilog netlist (evaluated by
csource.py / netlist.py on all 65,536 operand pairs), TFApprox's .bin and AdaPT/TransAxx-style C
headers (peers.py), with the figures a circuit's header publishes.

Each decision the file does not state outright is reported in the notes, never taken silently:
  operand order   the input named A (any case) is the activation (rows), B the weight (columns),
                  as EvoApproxLib names them; other names need --activation-operand NAME.
  signedness      --signed/--unsigned; else signed parameter types (int8_t) or `signed` ports; else
                  the library's names (mul8s_* signed, mul8u_* unsigned); else the values: the
                  interpretation that fits a*b clearly better (two's complement 16-bit product for
                  signed), or an error asking for the flag.
"""

from __future__ import annotations

import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from . import bitslice as bs
from . import csource, netlist, tokens
from .core import exact_table
from .io import check_layout, check_range, raw_bytes_to_offset128, signed_by_name
from .metrics import compute_metrics, matches_published, published_convention, within_rounding

CIRCUIT_SUFFIXES = (".c", ".v")
MAX_SOURCE_BYTES = 16 << 20
# The header lines EvoApproxLib writes (`// MAE% = 0.0018 %`) and the manifest keys they become.
HEADER_KEYS = {"MAE%": "mae%", "MAE": "mae", "WCE%": "wce%", "WCE": "wce", "WCRE%": "wcre%", "EP%": "ep%",
               "MRE%": "mre%", "MSE": "mse", "PDK45_PWR": "pwr", "PDK45_AREA": "area", "PDK45_DELAY": "delay"}
_HEADER_LINE = re.compile(r"^\s*(?://|\*)\s*([A-Za-z0-9_%]+)\s*=\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)",
                          re.M)


@dataclass
class Loaded:
    """A table read from any supported file, in our layout, with what was decided and published."""
    values: np.ndarray          # int64 [256, 256], row = activation A, column = weight B
    signed: bool
    layout: str                 # the convention the file was read in (io.LAYOUTS)
    layout_note: str
    notes: list = field(default_factory=list)
    published: dict = field(default_factory=dict)
    seconds: float = 0.0


def read_source(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    size = path.stat().st_size
    if size > MAX_SOURCE_BYTES:
        raise UserError(f"{path}: {size:,} bytes; a multiplier circuit is far smaller "
                        f"(at most {MAX_SOURCE_BYTES:,} bytes are read)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text file (expected C or Verilog source)") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e})") from None
    if "\0" in text:
        raise UserError(f"{path}: not a text file (it holds NUL bytes)")
    if not text.strip():
        raise UserError(f"{path}: empty file")
    return text


def header_figures(text: str) -> dict:
    """The figures a circuit's header comment publishes, as strings keyed like the manifest."""
    head = text[: 4000]
    out = {}
    for key, value in _HEADER_LINE.findall(head):
        k = HEADER_KEYS.get(key.upper())
        if k and k not in out:
            out[k] = value
    return out


def compare_published(values: np.ndarray, signed: bool, published: dict) -> tuple[list, list]:
    """(figures that match, mismatch messages) of our metrics against a header's figures."""
    met = compute_metrics(values, signed)
    conv = published_convention(met, published)
    ours = {**conv, "mae": met["mae"], "wce": met["wce"], "mse": met["mse"]}
    ok, bad = [], []
    for k, v in ours.items():
        if k not in published:
            continue
        text = published[k]
        hit = matches_published(v, text) if k.endswith("%") else within_rounding(v, text)
        (ok if hit else bad).append(k if hit else f"{k.upper()} published {text}, computed {v:.6g}")
    return ok, bad


# ---------------------------------------------------------------- operand order and signedness

def _activation(names: list, chosen: str | None, where: str, what: str) -> tuple[str, str, str]:
    """(activation name, weight name, note)."""
    if chosen:
        hits = [n for n in names if n == chosen] or [n for n in names if n.lower() == chosen.lower()]
        if len(hits) != 1:
            raise UserError(f"--activation-operand {chosen}: {where} has the {what}s {' and '.join(names)}")
        act = hits[0]
        return act, next(n for n in names if n != act), f"operand order: {act} is the activation (rows), as given"
    upper = [n.upper() for n in names]
    if sorted(upper) == ["A", "B"]:
        act = names[upper.index("A")]
        wt = names[upper.index("B")]
        order = "" if upper[0] == "A" else f" (declared second: the {what}s are ({names[0]}, {names[1]}))"
        return act, wt, (f"operand order: {what} {act} is the activation (rows), {wt} the weight (columns), by "
                         f"their names{order}; --activation-operand {wt} swaps them")
    raise UserError(f"{where}: cannot tell which operand is the activation: the {what}s are {' and '.join(names)}, "
                    f"not A and B. Say which with --activation-operand {names[0]} (or {names[1]})")


def _pattern_fit(pattern: np.ndarray, signed: bool) -> float:
    values = as_values(pattern, signed)
    exact = exact_table(signed)
    return float(np.abs(values - exact).mean()) / float(np.abs(exact).mean())


def as_values(pattern: np.ndarray, signed: bool) -> np.ndarray:
    """16-bit product patterns indexed by operand codes -> our layout (signed: two's complement, offset-128)."""
    if not signed:
        return pattern.astype(np.int64)
    return raw_bytes_to_offset128(pattern.astype(np.uint16).view(np.int16).astype(np.int64))


def decide_signed(pattern, flag: bool | None, declared: tuple, where: str, names) -> tuple[bool, str]:
    """Signedness of a table of 16-bit product patterns (or {signed: patterns} where the circuit gives
    different ones per reading): flag, declaration, name, or the values; a choice the values contradict
    clearly (the other reading fits a*b at least twice as well) is refused."""
    by_name = signed_by_name(names)
    kind = {True: "signed", False: "unsigned"}
    patterns = pattern if isinstance(pattern, dict) else {True: pattern, False: pattern}
    fit = {s: _pattern_fit(patterns[s], s) for s in (True, False)}
    if flag is not None:
        s, why = flag, f"{kind[flag]}: as given"
    elif declared[0] is not None:
        if by_name is not None and by_name != declared[0]:
            raise UserError(f"{where}: {declared[1]} says {kind[declared[0]]}, the name says {kind[by_name]}; "
                            f"say which with --signed or --unsigned")
        s, why = declared[0], f"{kind[declared[0]]}: {declared[1]}"
    elif by_name is not None:
        s, why = by_name, f"{kind[by_name]}: from the name ({'mul8s_*' if by_name else 'mul8u_*'}, EvoApproxLib's convention)"
    elif fit[True] != fit[False] and min(fit.values()) * 2 <= max(fit.values()):
        s = fit[True] < fit[False]
        return s, (f"{kind[s]}: decided from the values (mean |error| relative to mean |a*b|: {fit[s]:.3g} read as "
                   f"{kind[s]}, {fit[not s]:.3g} as {kind[not s]}); --signed/--unsigned overrides")
    else:
        raise UserError(f"{where}: nothing says whether the operands are signed (no signed types or ports, no "
                        f"mul8s_/mul8u_ name) and the products fit both readings alike; pass --signed or --unsigned")
    if fit[s] > 2 * fit[not s] and fit[not s] < 1:
        flag_hint = "--signed" if not s else "--unsigned"
        raise UserError(f"{where}: read as {kind[s]} ({why.split(': ', 1)[1]}), but the products fit a {kind[not s]} "
                        f"multiplier far better (mean |error| relative to mean |a*b|: {fit[s]:.3g} vs {fit[not s]:.3g}); "
                        f"pass {flag_hint} if that is what it is")
    return s, why


def _check_upper(result: list, signed: bool, where: str) -> None:
    """Bits above the 16-bit product must be zero (unsigned) or zero or a sign extension (signed)."""
    upper = result[16:]
    if not upper:
        return
    nonzero = bs.any_bit(upper)
    if signed:
        nonzero = bs.AND(nonzero, bs.any_bit([bs.XOR(s, result[15]) for s in upper]))
    nonzero = bs.fold(nonzero)
    if isinstance(nonzero, int) and not nonzero:
        return
    pair = int(np.flatnonzero(bs.unpack(nonzero))[0])
    raise UserError(f"{where}: the result has bits above the 16-bit product (first at operand codes "
                    f"A={pair >> 8}, B={pair & 255}); an 8x8 multiplier's product has 16 bits")


def evaluate_circuit(path: Path, text: str, activation: str | None):
    """(run(extend_signed) -> result slices, wide, names, declared signedness (bool|None, why), notes) of a
    .c or .v file. `wide`: a parameter is wider than the 8-bit operand, so the operand's extension into
    it (sign or zero, i.e. the multiplier's signedness) changes the result."""
    where = str(path)
    if path.suffix.lower() == ".c":
        fname, params, _ = csource.parameters(text, where)
        if len(params) != 2:
            raise UserError(f"{where}: {fname} takes {len(params)} parameters; a multiplier takes two operands")
        names = [p[0] for p in params]
        act, wt, note = _activation(names, activation, where, "parameter")
        types = [p[1] for p in params]
        wide = any(t.bits > 8 for t in types)
        declared = ((True, f"parameters declared {types[0]}") if all(t.signed and t.bits == 8 for t in types)
                    else (None, ""))

        def run(extend_signed: bool) -> list:
            ops = {act: bs.operand_bits(0), wt: bs.operand_bits(1)}
            return csource.evaluate(text, where, ops, extend_signed=extend_signed).result
    else:
        design = netlist.load(text, where)
        fname = design.top.module.name
        names = [n.name for n in design.inputs]
        act, wt, note = _activation(names, activation, where, "input")
        wide = False
        declared = (True, "inputs declared signed") if all(n.signed for n in design.inputs) else (None, "")

        def run(extend_signed: bool) -> list:
            return design.run({act: bs.operand_bits(0), wt: bs.operand_bits(1)})
    return run, wide, (fname, path.name), declared, [note]


@contextmanager
def _bounded(path: Path):
    """Room for the parsers' and evaluators' recursion over expressions nested up to tokens.MAX_NESTING
    levels (a few Python frames per level; pure-Python frames, no C stack, since Python 3.11), and every
    message with its names cut short (a million-character identifier is quoted in 100 characters)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 12 * tokens.MAX_NESTING))
    try:
        yield
    except UserError as e:
        raise UserError(tokens.shorten(str(e))) from None
    except (RecursionError, MemoryError) as e:  # a limit above let something through: still one message
        raise UserError(f"{path}: the circuit is too large or too deeply nested to evaluate "
                        f"({type(e).__name__}); see the importer's limits in docs/multipliers.md") from None
    finally:
        sys.setrecursionlimit(old)


def load_circuit(path: Path, signed: bool | None = None, *, activation: str | None = None, name: str = "",
                 expect_exact: bool = False) -> Loaded:
    """Evaluate a circuit file on all operand pairs and validate the table it gives."""
    start = time.perf_counter()
    text = read_source(path)
    with _bounded(path):
        run, wide, names, declared, notes = evaluate_circuit(path, text, activation)
        names = names + (name,)
        known = signed if signed is not None else declared[0] if declared[0] is not None else signed_by_name(names)
        if wide and known is None:
            # the operands' extension into the wide parameters is the signedness itself: evaluate both readings
            results = {True: run(True), False: run(False)}
        else:
            results = dict.fromkeys((True, False), run(bool(known)))
    patterns = {s: bs.to_codes(r[:16]).reshape(256, 256) for s, r in results.items()}
    signed, why = decide_signed(patterns, signed, declared, str(path), names)
    if wide:
        notes.append(f"operands passed as {'values -128..127 sign' if signed else 'codes 0..255 zero'}-extended "
                     f"to the wider parameters")
    _check_upper(results[signed], signed, str(path))
    values = as_values(patterns[signed], signed)
    loaded = finish(values, signed, str(path), notes + [why], expect_exact, names)
    loaded.published = header_figures(text)
    loaded.seconds = time.perf_counter() - start
    return loaded


def finish(values: np.ndarray, signed: bool, where: str, notes: list, expect_exact: bool, names) -> Loaded:
    """Layout checks shared by the pattern formats (circuits, .bin): values already in our layout."""
    layout = "offset128" if signed else "unsigned"
    report = check_layout(values, signed, where, expect_exact=expect_exact, layout=layout, names=names)
    check_range(values, signed, lambda r, c: f"{where}: product [{r}, {c}]")
    return Loaded(values, signed, report.layout, report.note, notes)
