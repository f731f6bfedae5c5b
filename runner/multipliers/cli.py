"""`approx-run lut ...`: list, show, import and export multipliers.

runner/cli.py calls main(argv) with the arguments after "lut"."""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from ..console import print_table
from ..errors import ArgumentParser, UserError
from ..jobs.argv import command_line
from .circuits import compare_published
from .io import SUFFIXES
from .peers import EXPORT_FORMATS, export, load_table
from .metrics import metrics_of, published_convention
from .registry import get, import_table, list_multipliers, shipped_names, user_dir, user_names

METRIC_COLUMNS = [("mae_pct", "MAE%"), ("wce_pct", "WCE%"), ("ep_pct", "EP%"), ("mre_pct", "MRE%"),
                  ("mean_error", "bias"), ("error_std", "err std")]
HW_COLUMNS = [("pwr", "power mW"), ("area", "area um2"), ("delay", "delay ns")]


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="approx-run lut",
                       description="Approximate 8x8 multipliers: list, inspect, import, export.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{list,show,import,export}")
    ls = sub.add_parser("list", help="table of every available multiplier with its error metrics")
    ls.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    sh = sub.add_parser("show", help="metrics of one multiplier and a PNG heatmap of its error table")
    sh.add_argument("name", help="multiplier name, or a table or circuit file (.txt, .txt.gz, .npy, .bin, .h, .c, .v)")
    sh.add_argument("--out", metavar="PNG", help="heatmap path (default results/lut/<name>_error.png)")
    sh.add_argument("--no-plot", action="store_true", help="print the metrics only")
    im = sub.add_parser("import", help="validate a table or circuit file and register it under a name",
                        description="Tables: rows must be operand A (activation), columns operand B (weight); "
                                    "approximate multipliers are often not commutative. Circuits (.c C model, "
                                    ".v Verilog netlist) are evaluated on all 65,536 operand pairs, never compiled "
                                    "or run; their header figures (MAE%%, WCE%%, EP%%, power...) are read and checked.")
    im.add_argument("file", help="table (.txt, .txt.gz, .npy: 256 rows x 256 integers; TFApprox .bin; C header .h "
                                 "with a [256][256] array) or circuit (.c, .v)")
    im.add_argument("--name", help="name to register it under (default: the file name without its suffix)")
    im.add_argument("--activation-operand", metavar="NAME", default=None,
                    help="circuits: the parameter/input that is the activation (default: the one named A)")
    g = im.add_mutually_exclusive_group()
    g.add_argument("--signed", dest="signed", action="store_true", default=None,
                   help="operands -128..127 (default: from the declared types, the name, else the values)")
    g.add_argument("--unsigned", dest="signed", action="store_false", help="operands 0..255")
    im.add_argument("--layout", default="auto", choices=["auto", "offset128", "raw_bytes", "unsigned"],
                    help="index convention of the file (default: detected)")
    im.add_argument("--transpose", action="store_true", help="the file has B on rows: transpose it")
    im.add_argument("--force", action="store_true", help="replace an earlier import of the same name")
    im.add_argument("--power-mw", type=float, default=None, metavar="MW",
                    help="the circuit's power in mW, for energy estimates (EvoApproxLib's `pwr` convention)")
    ex = sub.add_parser("export", help="write a multiplier's table for another tool",
                        description="txt: our text layout (.txt or .txt.gz); npy: int32 [256, 256] in our layout; "
                                    "bin: TFApprox, 65,536 little-endian uint16 at a*256+b (signed: two's-complement "
                                    "patterns at raw byte codes); h: C header with a [256][256] array (signed: int16_t "
                                    "in raw byte order, as AdaPT/TransAxx index it).")
    ex.add_argument("name", help="multiplier name, or a table or circuit file")
    ex.add_argument("--format", required=True, choices=list(EXPORT_FORMATS))
    ex.add_argument("--out", metavar="PATH", help="output file (default results/lut/<name>.<format>)")
    return p


def _kind(name: str) -> str:
    if name in shipped_names():
        return "EvoApproxLib"
    if name in user_names():
        return "user"
    return "generated"


def _rows() -> list[dict]:
    rows = []
    for name in list_multipliers():
        m = get(name)
        met = metrics_of(m)
        row = {"name": m.name, "signed": m.signed, "kind": _kind(name)}
        row.update({k: met[k] for k, _ in METRIC_COLUMNS})
        row.update({k: m.published.get(k, "") for k, _ in HW_COLUMNS})
        row["sha256"] = m.sha256
        rows.append(row)
    return rows


def _number(text):
    """A published figure (a string in the manifest) as a number for the table; "" stays empty."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def cmd_list(args) -> int:
    rows = _rows()
    shown = [{"name": r["name"], "signed": "yes" if r["signed"] else "no", "kind": r["kind"],
              **{h: r[k] for k, h in METRIC_COLUMNS}, **{h: _number(r[k]) for k, h in HW_COLUMNS}} for r in rows]
    print_table(shown, "Multipliers (metrics over all 65,536 operand pairs; MAE%/WCE% of 2^16)")
    if args.csv:
        path = Path(args.csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {path}")
    return 0


def _lookup(name: str):
    if any(name.lower().endswith(s) for s in SUFFIXES) and Path(name).exists():
        return load_table(name)
    return get(name)


def cmd_export(args) -> int:
    m = _lookup(args.name)
    out = Path(args.out) if args.out else Path("results") / "lut" / f"{m.name}.{args.format}"
    print(f"wrote {export(m, args.format, out)} ({args.format}, {'signed' if m.signed else 'unsigned'}, "
          f"sha256 {m.sha256[:16]}...)")
    return 0


def plot_error(m, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("the heatmap needs matplotlib: pip install matplotlib "
                        "(or pass --no-plot to print the metrics only)") from None
    err = m.error_table()
    lim = max(int(abs(err).max()), 1)
    lo, hi = m.operand_range
    fig, ax = plt.subplots(figsize=(6.4, 5.4))
    im = ax.imshow(err, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest",
                   extent=[lo - 0.5, hi + 0.5, hi + 0.5, lo - 0.5])
    ax.set_xlabel("B (weight)")
    ax.set_ylabel("A (activation)")
    met = metrics_of(m)
    ax.set_title(f"{m.name}: error = approx - A*B\nMAE% {met['mae_pct']:.3g}, WCE% {met['wce_pct']:.3g}, "
                 f"EP% {met['ep_pct']:.2f}", fontsize=10)
    fig.colorbar(im, ax=ax, label="error")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def cmd_show(args) -> int:
    m = _lookup(args.name)
    met = metrics_of(m)
    lo, hi = m.operand_range
    pub_keys = {"mae_pct": "mae%", "wce_pct": "wce%", "ep_pct": "ep%", "mre_pct": "mre%", "wcre_pct": "wcre%"}
    # Published figures use EvoApproxLib's rounding (MAE rounded to 0.1 before MAE%).
    conv = published_convention(met, m.published)
    rows = []
    for k, v in met.items():
        row = {"metric": k, "ours": v}
        if m.published:
            pk = pub_keys.get(k)
            pub = str(m.published.get(pk, "")) if pk else ""
            decimals = len(pub.split(".")[1]) if "." in pub else 0
            row.update({"ours, as EvoApproxLib reports": f"{conv[pk]:.{decimals}f}" if pub else "", "published": pub})
        rows.append(row)
    print_table(rows, f"{m.name} ({'signed' if m.signed else 'unsigned'}, operands {lo}..{hi})")
    for k, _ in HW_COLUMNS:
        if k in m.published:
            print(f"{k}: {m.published[k]}")
    print(f"source: {m.source}")
    print(f"sha256: {m.sha256}")
    if m.params:
        print(f"params: {m.params}")
    if not args.no_plot:
        out = Path(args.out) if args.out else Path("results") / "lut" / f"{m.name}_error.png"
        print(f"wrote {plot_error(m, out)}")
    return 0


def cmd_import(args) -> int:
    start = time.perf_counter()
    m = import_table(args.file, args.name, args.signed, transpose=args.transpose, layout=args.layout,
                     force=args.force, power_mw=args.power_mw, activation=args.activation_operand)
    seconds = time.perf_counter() - start
    met = metrics_of(m)
    verb = "checked" if "shipped" in m.params else "imported"
    print(f"{verb} {m.name} ({'signed' if m.signed else 'unsigned'}), {m.params['layout_note']}")
    for note in m.params.get("notes", []):
        print(f"  {note}")
    print(f"  {verb} in {seconds:.2f} s (read, evaluate, validate{'' if verb == 'checked' else ', store'})")
    print(f"MAE% {met['mae_pct']:.4g}  WCE% {met['wce_pct']:.4g}  EP% {met['ep_pct']:.2f}  "
          f"MRE% {met['mre_pct']:.4g}")
    if m.published:
        ok, bad = compare_published(m.lut.numpy(), m.signed, m.published)
        hw = ", ".join(f"{k} {m.published[k]}" for k, _ in HW_COLUMNS if k in m.published)
        if ok:
            print(f"header figures reproduced: {', '.join(k.upper() for k in ok)}" + (f"; hardware: {hw}" if hw else ""))
        for msg in bad:
            print(f"MISMATCH with the header: {msg}")
    if "shipped" in m.params:
        print(f"identical to the shipped table {m.params['shipped']} (sha256 {m.sha256[:16]}...): nothing registered; "
              f"select it with multiplier={m.params['shipped']}")
    else:
        print(f"stored in {user_dir()}; select it with multiplier=named multiplier.name={m.name}")
    return 0


def main(argv=None) -> int:
    argv = command_line(argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on --help; keep main() in-process
        return int(e.code or 0)
    except UserError as e:  # a usage error: one line with the nearest options
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return {"list": cmd_list, "show": cmd_show, "import": cmd_import, "export": cmd_export}[args.cmd](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
