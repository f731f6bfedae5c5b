"""`approx-run results`: filter, sort, pivot and plot the rows of results CSVs (the store's file by
default, or run/sweep dirs), as a table, CSV or Markdown."""
from __future__ import annotations

import argparse
import ast
import io
import operator
import re
import sys
import tokenize
from pathlib import Path

import numpy as np
import pandas as pd

from runner.console import fmt_number, print_table
from runner.errors import ArgumentParser, UserError
from runner.provenance import atomic_write_bytes
from runner.store import read_csv

DEFAULT_COLUMNS = ["data", "quant", "multiplier", "path", "scope", "backend", "status", "accuracy", "agreement_fakequant",
                   "latency_ms_median", "throughput_img_s", "mult_mae_pct", "op_acc_nrmse", "mult_energy_rel",
                   "error"]


# What tells rows apart beyond DEFAULT_COLUMNS, so that two rows never look alike: the model whenever the
# shown rows have several (a LeNet-5 and a ResNet-8 row of one multiplier), the others whenever they tell
# apart rows that agree on every identity column shown (two assignments, two image counts, two seeds).
IDENTITY_COLUMNS = ["model", "multiplier_per_layer", "finetune_grad", "algo", "n_images", "seed", "device"]


def _text(col: pd.Series) -> pd.Series:
    return col.astype(str).where(col.notna(), "")


def default_columns(df: pd.DataFrame) -> list[str]:
    """DEFAULT_COLUMNS that df has (error only when some row has one), with the identity columns that tell
    its rows apart inserted before status."""
    cols = [c for c in DEFAULT_COLUMNS if c in df.columns and (c != "error" or (df[c].notna() & df[c].astype(str).ne("")).any())]
    shown = [c for c in ("data", "quant", "multiplier", "path", "scope", "backend") if c in cols]
    extra = []
    for c in IDENTITY_COLUMNS:
        if c not in df or c in cols:
            continue
        values = _text(df[c])
        if c == "model":
            tells = values.nunique() > 1
        else:
            keys = [_text(df[k]) for k in shown + extra]
            tells = (values.groupby(keys).nunique() > 1).any() if keys else values.nunique() > 1
        if tells:
            extra.append(c)
    at = cols.index("status") if "status" in cols else len(cols)
    return cols[:at] + extra + cols[at:]


def load_results(sources: list[str] | None = None) -> pd.DataFrame:
    """Rows of the given CSV files and run/sweep dirs (every metrics.csv below a dir), default
    results/results.csv."""
    sources = list(sources or ["results/results.csv"])
    frames = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files = [p / "results.csv"] if (p / "results.csv").is_file() else sorted(p.rglob("metrics.csv"))
            if not files:
                raise UserError(f"{p} holds no results.csv and no run dir with a metrics.csv.")
        elif p.is_file():
            files = [p]
        else:
            hint = " Run `approx-run compare` or `approx-run sweep` first." if src == sources[0] else ""
            raise UserError(f"no results file {p}.{hint}")
        frames += [df for df in (read_csv(f) for f in files) if not df.empty]
    if not frames:
        raise UserError(f"no result rows in {', '.join(sources)}.")
    return pd.concat(frames, ignore_index=True, sort=False)


def _layer_counts(df: pd.DataFrame) -> pd.Series:
    """How many layers each row's multiplier_per_layer names (0 where it has none)."""
    per = df["multiplier_per_layer"] if "multiplier_per_layer" in df else pd.Series("", index=df.index)
    return per.fillna("").astype(str).map(lambda t: len([p for p in t.split(";") if "=" in p]))


def with_scope(df: pd.DataFrame) -> pd.DataFrame:
    """df with its scope column filled in. Rows written before the column existed get it from the others:
    pytorch/fakequant are reference, approx_finetuned finetuned, a multiplier "mixed" an assignment, and an
    approx row naming fewer layers in multiplier_per_layer than the most any row of the same model names is
    a layer row (sensitivity); the rest are network rows."""
    df = df.copy()
    if df.empty:
        return df
    scope = df["scope"].fillna("").astype(str) if "scope" in df else pd.Series("", index=df.index)
    missing = scope == ""
    if missing.any():
        path = df["path"].fillna("").astype(str) if "path" in df else pd.Series("", index=df.index)
        mult = df["multiplier"].fillna("").astype(str) if "multiplier" in df else pd.Series("", index=df.index)
        model = df["model"].fillna("").astype(str) if "model" in df else pd.Series("", index=df.index)
        counts = _layer_counts(df)
        most = counts.groupby(model).transform("max")
        inferred = pd.Series("network", index=df.index)
        inferred[(counts > 0) & (counts < most)] = "layer"
        inferred[mult == "mixed"] = "assignment"
        inferred[path == "approx_finetuned"] = "finetuned"
        inferred[path.isin(["pytorch", "fakequant"])] = "reference"
        scope = scope.where(~missing, inferred)
    df["scope"] = scope
    return df


def parse_scopes(text: str) -> set[str]:
    """--scope's value: comma-separated scopes, or all."""
    from runner.store import SCOPES

    wanted = set(_split(text))
    if wanted == {"all"}:
        return set(SCOPES)
    unknown = sorted(wanted - set(SCOPES))
    if unknown or not wanted:
        raise UserError(f"--scope {text}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                        f"choose from {', '.join(SCOPES)} (comma-separated), or all.")
    return wanted


def select_scopes(df: pd.DataFrame, wanted: set[str]) -> tuple[pd.DataFrame, dict[str, int]]:
    """(the rows of the wanted scopes, reference rows always, {left-out scope: rows})."""
    keep = df["scope"].isin(wanted | {"reference"})
    return df[keep], df.loc[~keep, "scope"].value_counts().to_dict()


def left_out_note(left: dict[str, int], wanted: set[str]) -> str:
    if not left:
        return ""
    counts = ", ".join(f"{n} {s}" for s, n in sorted(left.items()))
    return (f"results: {'/'.join(sorted(wanted))} rows only (and the references); left out {counts} rows. "
            f"--scope all shows every row, --scope {','.join(sorted(wanted | set(left)))} picks kinds.")


def _check_columns(df: pd.DataFrame, cols: list[str], what: str) -> None:
    unknown = [c for c in cols if c not in df.columns]
    if unknown:
        raise UserError(f"{what}: unknown column(s) {', '.join(unknown)}. Columns: {', '.join(df.columns)}")


def _split(text: str | None) -> list[str]:
    return [c.strip() for c in (text or "").split(",") if c.strip()]


_WHERE_HELP = ("--where takes column names (`backquoted` when not plain names), string/number/True/False literals "
               "and lists of them, comparisons (== != < <= > >=, in, not in), and/or/not (or & | ~) and arithmetic "
               "(+ - * / // % **); no calls, attributes, subscripts or @names. "
               "Example: --where \"backend=='cpp' and accuracy > 0.9\"")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge}
_MAX_WHERE = 2000  # characters: a query is a line typed by a person; this bounds the parser's recursion too


def _backquoted(where: str) -> tuple[str, dict[str, str]]:
    """where with each `column name` replaced by a plain placeholder name, and placeholder -> column."""
    names: dict[str, str] = {}

    def sub(m: re.Match) -> str:
        key = f"__bq{len(names)}__"
        names[key] = m.group(1)
        return key
    return re.sub(r"`([^`]*)`", sub, where), names


def _booleans(text: str) -> str:
    """text with & and | read as `and` and `or`, as pandas' query reads them: `a == 1 & b == 2` is
    (a == 1) and (b == 2), not a == (1 & b) == 2."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        kind, string = tok.type, tok.string
        if kind == tokenize.OP and string in ("&", "|"):
            kind, string = tokenize.NAME, "and" if string == "&" else "or"
        out.append((kind, string))
    return tokenize.untokenize(out)


def _where_eval(node: ast.AST, df: pd.DataFrame, names: dict[str, str]):
    """The value of one node of a checked --where expression over df's columns (the only names in reach)."""
    ev = lambda n: _where_eval(n, df, names)  # noqa: E731
    if isinstance(node, ast.Expression):
        return ev(node.body)
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [ev(e) for e in node.elts]
        if any(isinstance(i, (pd.Series, list)) for i in items):
            raise _WhereError("a list holds literals only")
        return items
    if isinstance(node, ast.Name):
        col = names.get(node.id, node.id)
        if col in df.columns:
            return df[col]
        if node.id.startswith("__bq"):
            raise _WhereError(f"unknown column `{col[:80]}`")
        raise _WhereError(f"unknown column {col[:80]!r}")
    if isinstance(node, ast.BoolOp):
        vals = [ev(v) for v in node.values]
        op = operator.and_ if isinstance(node.op, ast.And) else operator.or_
        out = vals[0]
        for v in vals[1:]:
            out = op(out, v)
        return out
    if isinstance(node, ast.UnaryOp):
        v = ev(node.operand)
        if isinstance(node.op, (ast.Not, ast.Invert)):
            return ~v if isinstance(v, pd.Series) else not v
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.Compare):
        out, left = True, ev(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = ev(right_node)
            if isinstance(op, (ast.In, ast.NotIn)) or (isinstance(op, (ast.Eq, ast.NotEq)) and isinstance(right, list)):
                # pandas' query reads `col == [a, b]` as `col in [a, b]`
                if not isinstance(right, list):
                    raise _WhereError("`in` takes a list, e.g. multiplier in ['exact_s', 'mul8s_1L2N']")
                hit = left.isin(right) if isinstance(left, pd.Series) else left in right
                res = hit if isinstance(op, (ast.In, ast.Eq)) else ~hit if isinstance(hit, pd.Series) else not hit
            else:
                res = _CMPOPS[type(op)](left, right)
            out = res if out is True else out & res
            left = right
        return out
    what = {ast.Call: "calls", ast.Attribute: "attribute access", ast.Subscript: "subscripts",
            ast.Lambda: "lambdas", ast.IfExp: "if-expressions", ast.NamedExpr: "assignments"}
    kind = next((w for t, w in what.items() if isinstance(node, t)),
                f"operator {type(node.op).__name__}" if isinstance(node, ast.BinOp) else type(node).__name__)
    raise _WhereError(f"{kind}: not allowed")


class _WhereError(Exception):
    pass


def query(df: pd.DataFrame, where: str) -> pd.DataFrame:
    """The rows of df where the --where condition holds, evaluated on the columns alone: the expression is
    parsed and walked here, never handed to pandas' or Python's eval, so it can reach nothing but the
    columns and literals."""
    shown = where if len(where) <= 120 else where[:120] + "..."
    if len(where) > _MAX_WHERE:
        raise UserError(f"--where {shown!r}: longer than {_MAX_WHERE} characters. {_WHERE_HELP}")
    text, names = _backquoted(where)
    try:
        tree = ast.parse(_booleans(text.strip()).strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, tokenize.TokenError) as exc:
        if re.search(r"@\s*[A-Za-z_]", text):
            raise UserError(f"--where {shown!r}: @names (Python variables) are not allowed. {_WHERE_HELP}") from None
        raise UserError(f"--where {shown!r} is not a valid query ({type(exc).__name__}: "
                        f"{getattr(exc, 'msg', exc)}). {_WHERE_HELP}. Columns: {', '.join(df.columns)}") from None
    try:
        mask = _where_eval(tree, df, names)
    except _WhereError as exc:
        raise UserError(f"--where {shown!r}: {exc}. {_WHERE_HELP}. Columns: {', '.join(df.columns)}") from None
    except RecursionError:
        raise UserError(f"--where {shown!r}: nested too deeply. {_WHERE_HELP}") from None
    except Exception as exc:  # noqa: BLE001  (pandas raises many kinds for an ill-typed comparison)
        raise UserError(f"--where {shown!r} could not be evaluated ({type(exc).__name__}: {exc}). "
                        f"{_WHERE_HELP}") from None
    if isinstance(mask, (bool, np.bool_)):
        mask = pd.Series(bool(mask), index=df.index)
    if not isinstance(mask, pd.Series) or not pd.api.types.is_bool_dtype(mask.dtype):
        raise UserError(f"--where {shown!r} must be a boolean condition on the rows. {_WHERE_HELP}")
    return df[mask.fillna(False).astype(bool)]


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def _signed_of(df: pd.DataFrame) -> dict:
    """multiplier name -> signed, from approx rows (fakequant rows only carry the name)."""
    if "multiplier_signed" not in df:
        return {}
    a = df[(df["path"] == "approx") & df["multiplier_signed"].notna()]
    return {str(n): str(s).lower() == "true" for n, s in zip(a["multiplier"], a["multiplier_signed"])}


def pivot(df: pd.DataFrame, value: str = "accuracy") -> pd.DataFrame:
    """One row per multiplier (and per data/model/quant when those vary), one column per path: approx
    per backend, with the fp32 (pytorch) and fakequant references of the same data/model/quant (and
    multiplier signedness) filled in, since sweeps record those once, not per multiplier."""
    _check_columns(df, ["path", "multiplier", value], "--pivot")
    df = _ok(df).copy()
    for c in ("data", "model", "quant", "backend"):
        if c not in df:
            df[c] = ""
    df["multiplier"] = df["multiplier"].fillna("").astype(str)
    approx = df[df["path"].isin(["approx", "approx_finetuned"])]
    if approx.empty:
        raise UserError("--pivot: no successful approx rows to pivot (check --where and --scope).")
    if "scope" in approx:  # layer and assignment rows: one line per set of approximated layers, not per table
        # a retrained row names fewer layers than its own model's network rows when it retrained some only;
        # the count of another model (ResNet-8 has more layers than LeNet-5) says nothing about it
        most = _layer_counts(df).groupby([df["data"].astype(str), df["model"].astype(str)]).max()
        own = pd.Series([most.get((str(d), str(m)), 0) for d, m in zip(approx["data"], approx["model"])],
                        index=approx.index)
        partial = approx["scope"].isin(["layer", "assignment"]) | (
            (approx["scope"] == "finetuned") & (_layer_counts(approx) < own))
        per = approx["multiplier_per_layer"].fillna("").astype(str) if "multiplier_per_layer" in approx else ""
        approx = approx.assign(layers=per.where(partial, "all") if partial.any() else "all")
    keys = [c for c in ("data", "model", "quant") if approx[c].nunique() > 1]
    backends = sorted(approx["backend"].astype(str).unique())
    # retrained rows get a column each (per gradient when several were used) beside the approx one
    grads = approx["finetune_grad"] if "finetune_grad" in approx else pd.Series("", index=approx.index)
    several = grads[approx["path"] == "approx_finetuned"].nunique() > 1
    approx = approx.assign(col=[p + (f"_{g}" if p != "approx" and several else "") + (f"_{b}" if len(backends) > 1 else "")
                                for p, g, b in zip(approx["path"], grads, approx["backend"])])
    layered = "layers" in approx and (approx["layers"] != "all").any()
    table = approx.pivot_table(index=keys + ["multiplier"] + (["layers"] if layered else []), columns="col",
                               values=value, aggfunc="last")
    table.columns.name = None
    table = table.reset_index()
    signed = _signed_of(df)
    ref = {}
    for path, by in (("pytorch", ["data", "model"]), ("fakequant", ["data", "model", "quant"])):
        rows = df[df["path"] == path]
        for _, r in rows.iterrows():
            k = tuple(str(r[c]) for c in by) + ((signed.get(str(r["multiplier"])),) if path == "fakequant" else ())
            ref[(path, k)] = r[value]
    meta = approx.groupby("multiplier").last()
    for path, by in (("pytorch", ["data", "model"]), ("fakequant", ["data", "model", "quant"])):
        vals = []
        for _, r in table.iterrows():
            m = meta.loc[r["multiplier"]]
            k = tuple(str(r[c]) if c in keys else str(m[c]) for c in by)
            if path == "fakequant":
                k += (signed.get(r["multiplier"]),)
            vals.append(ref.get((path, k)))
        table.insert(len(keys) + 1 + layered + (path == "fakequant"), path, vals)
    return table


def to_markdown(df: pd.DataFrame) -> str:
    cells = [[fmt_number(v).replace("|", "\\|").replace("\n", " ") for v in row] for row in df.itertuples(index=False)]
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "|".join("---" for _ in df.columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells]) + "\n"


def pareto_front(x, y) -> list[int]:
    """Indices of the points no other point beats (lower or equal x and higher or equal y, one strictly)."""
    pts = sorted(range(len(x)), key=lambda i: (x[i], -y[i]))
    front, best = [], float("-inf")
    for i in pts:
        if y[i] > best:
            front.append(i)
            best = y[i]
    return front


MAX_PLOT_GROUPS = 12


def _plot_references(ok: pd.DataFrame, rows: pd.DataFrame) -> list[tuple[str, float, tuple]]:
    """(label, accuracy, style) of the fp32 and fake-quant rows of the same data set and model as rows (and
    quant scheme, for fake-quant)."""
    out = []
    for path, by, style in (("pytorch", ("data", "model"), ("k", "--")),
                            ("fakequant", ("data", "model", "quant"), ("tab:blue", ":"))):
        r = ok[ok["path"] == path]
        for c in by:
            if c in r and c in rows:
                r = r[r[c].astype(str).isin(set(rows[c].astype(str)))]
        if not r.empty:
            acc = float(r["accuracy"].iloc[-1])
            out.append((f"{'fp32' if path == 'pytorch' else 'fake-quant int8'} ({acc:.4f})", acc, style))
    return out


def _plot_panel(ax, per: pd.DataFrame, col: str, label: str, refs) -> None:
    d = per[per[col].notna()]
    x, y = d[col].astype(float).tolist(), d["accuracy"].astype(float).tolist()
    ax.scatter(x, y, s=22, color="tab:gray", label="multiplier")
    front = pareto_front(x, y)
    fx, fy = zip(*sorted((x[i], y[i]) for i in front)) if front else ((), ())
    ax.plot(fx, fy, "o-", color="tab:red", ms=6, label="Pareto front")
    # names of every point only while they stay legible; the front's always
    for i, name in enumerate(d.index):
        if len(x) <= 8 or i in front:
            ax.annotate(str(name), (x[i], y[i]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ref_label, acc, (color, ls) in refs:
        ax.axhline(acc, color=color, ls=ls, label=ref_label)
    if col == "mult_mae_pct" and x and min(x) >= 0:
        ax.set_xscale("symlog", linthresh=max(1e-4, min([v for v in x if v > 0], default=1e-3)))
        ax.set_xlim(left=0)
    if not x:
        ax.text(0.5, 0.5, "no multiplier has this figure", ha="center", transform=ax.transAxes)
    ax.set_xlabel(label)
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def plot(df: pd.DataFrame, out: Path) -> Path:
    """Accuracy of each multiplier against its MAE% and against its published power, Pareto front marked,
    fp32 and fakequant accuracy as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _ok(df)
    _check_columns(ok, ["path", "multiplier", "accuracy"], "--plot")
    approx = ok[ok["path"].isin(["approx", "approx_finetuned"])]
    if approx.empty:
        raise UserError("--plot: no successful approx rows to plot (check --where and --scope).")
    scopes = sorted(set(approx["scope"])) if "scope" in approx else ["network"]
    if len(scopes) > 1 or scopes[0] not in ("network", "finetuned"):
        raise UserError(f"--plot draws one point per table: one scope at a time, network (the default) or "
                        f"finetuned; these rows are {', '.join(scopes)}. Per-layer results have the sensitivity "
                        "heat map, assignments search's pareto.png.")
    # one row of panels per data set / model / quant / backend the rows hold, each with its own references
    split = [c for c in ("data", "model", "quant", "backend") if c in approx and approx[c].nunique() > 1]
    groups = list(approx.groupby(split, sort=True, dropna=False)) if split else [((), approx)]
    if len(groups) > MAX_PLOT_GROUPS:
        raise UserError(f"--plot: the rows hold {len(groups)} combinations of {', '.join(split)}, more than the "
                        f"{MAX_PLOT_GROUPS} rows of panels one figure shows; pick some with --where "
                        f"(e.g. --where \"{split[0]}=='{approx[split[0]].iloc[0]}'\").")
    fig = None
    for g, (_, rows) in enumerate(groups):
        per = rows.groupby("multiplier", sort=False).last(numeric_only=False)
        # energy where the rows have it (rows recorded before it existed have the published power only)
        cost = ("mult_energy_rel", "multiplier energy per inference (1 = exact 8-bit)") \
            if "mult_energy_rel" in per and per["mult_energy_rel"].notna().any() else \
            ("published_power_mw", "published power (mW)")
        panels = [(c, label) for c, label in (("mult_mae_pct", "mean absolute error (% of max product)"), cost)
                  if c in per]
        if not panels:
            raise UserError("--plot needs the mult_mae_pct, mult_energy_rel or published_power_mw columns "
                            "(written by compare).")
        if fig is None:
            fig, axes = plt.subplots(len(groups), len(panels), figsize=(6.5 * len(panels), 5 * len(groups)),
                                     squeeze=False)
        refs = _plot_references(ok, rows)
        for ax, (col, label) in zip(axes[g], panels):
            _plot_panel(ax, per, col, label, refs)
            if split:
                ax.set_title(" / ".join(f"{c}={rows[c].iloc[0]}" for c in split), fontsize=9)
    title = " / ".join(str(approx[c].iloc[0]) for c in ("data", "model", "quant", "backend")
                       if c in approx and c not in split)
    fig.suptitle(f"accuracy vs multiplier error and {'energy' if cost[0] == 'mult_energy_rel' else 'power'}"
                 + (f" ({title})" if title else ""))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return n


def _parser():
    p = ArgumentParser(
        prog="approx-run results", description="Filter, sort, pivot and plot result rows.",
        epilog="examples:\n"
               "  approx-run results --where \"backend=='cpp' and path=='approx'\" --sort accuracy --desc\n"
               "  approx-run results --pivot --markdown\n"
               "  approx-run results --pivot --scope network,finetuned    # retrained beside approx\n"
               "  approx-run results --scope layer --where \"multiplier=='mul8u_T83'\"\n"
               "  approx-run results results/sweep/2026-01-01_12-00-00 --plot sweep.png\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="*", help="CSV files or run/sweep dirs (default results/results.csv)")
    p.add_argument("--where", help="condition on the columns (comparisons, in, and/or/not, arithmetic), e.g. \"backend=='cpp' and accuracy > 0.9\"")
    p.add_argument("--sort", help="comma-separated columns to sort by")
    p.add_argument("--desc", action="store_true", help="sort descending")
    p.add_argument("--columns", help="comma-separated columns to show (default: a summary set)")
    p.add_argument("--all-columns", action="store_true", help="show every column")
    p.add_argument("--pivot", action="store_true", help="multiplier x path table of --value (accuracy)")
    p.add_argument("--value", default="accuracy", help="value column of --pivot (default accuracy)")
    p.add_argument("--scope", default="network", metavar="KINDS",
                   help="which rows, by what they approximated: network (default: every layer on one table), "
                        "layer (some layers: sensitivity), assignment (a table per layer: search), finetuned "
                        "(retrained), comma-separated, or all; pytorch/fakequant references are always kept")
    p.add_argument("--limit", type=_positive, help="show only the first N rows")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", nargs="?", const="-", metavar="FILE", help="write CSV (to stdout or FILE)")
    fmt.add_argument("--markdown", nargs="?", const="-", metavar="FILE", help="write a Markdown table")
    p.add_argument("--plot", metavar="PNG", help="accuracy vs MAE%% and vs published power, Pareto front marked")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    wanted = parse_scopes(args.scope)
    df = with_scope(load_results(args.sources))
    if args.where:  # before the scopes: the rows left out are counted among those --where keeps
        df = query(df, args.where)
    df, left = select_scopes(df, wanted)
    note = left_out_note(left, wanted)
    if note:  # on stderr: --csv and --markdown to stdout stay clean
        print(note, file=sys.stderr)
    if args.plot:
        out = plot(df, Path(args.plot))
        print(f"wrote {out}")
    if args.pivot:
        df = pivot(df, args.value)
    if args.sort:
        cols = _split(args.sort)
        _check_columns(df, cols, "--sort")
        df = df.sort_values(cols, ascending=not args.desc, kind="stable")
    if args.columns:
        cols = _split(args.columns)
        _check_columns(df, cols, "--columns")
        df = df[cols]
    elif not args.pivot and not args.all_columns and (args.csv is None):
        df = df[default_columns(df)]
    if args.limit:
        df = df.head(args.limit)
    if args.csv is not None:
        text = df.to_csv(index=False)
    elif args.markdown is not None:
        text = to_markdown(df)
    else:
        if args.plot and not (args.pivot or args.where or args.sort or args.columns):
            return 0
        print_table(df, title=f"{len(df)} rows")
        return 0
    dest = args.csv if args.csv is not None else args.markdown
    if dest == "-":
        print(text, end="")
    else:
        atomic_write_bytes(Path(dest), text.encode())
        print(f"wrote {dest}")
    return 0
