"""Accuracy of quant.requant=float against quant.requant=integer, per shipped table, fake-quant and approx.

    python benchmarks/requant_modes.py --checkpoints DIR --out benchmarks/requant_modes_mnist5k.csv
    python benchmarks/requant_modes.py --checkpoints DIR --out benchmarks/requant_modes_fashion_mnist.csv \
        data=fashion_mnist data.root=/work/data/fashion-mnist
    python benchmarks/requant_modes.py ... --backends python --multipliers '[mul8s_1L2N,mul8u_T83]'
                                                                     # the python reference (slow)

Runs `approx-run sweep sweep.multipliers='mul8*'` once per (mode, backend) into its own results directory
(a fresh process each, as a user runs it; the baseline in --checkpoints is trained by the first run if
missing) and writes one row per (table, backend): accuracy and agreement with fake-quant in both modes,
the fake-quant accuracy in both modes, and the differences in points. Extra arguments are passed to every
sweep (data=..., multiplier globs: sweep.multipliers=...)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
MODES = ("float", "integer")


def sweep(mode: str, backend: str, checkpoints: str, results: Path, extra: list[str],
          multipliers: str = "mul8*") -> pd.DataFrame:
    args = [sys.executable, "-m", "runner.cli", "sweep", f"sweep.multipliers={multipliers}", f"quant.requant={mode}",
            f"backend={backend}", f"paths.checkpoints={checkpoints}", f"paths.results={results}", *extra]
    print("+", " ".join(args[2:]), flush=True)
    subprocess.run(args, cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    rows = pd.read_csv(results / "results.csv")
    return rows[rows.status == "ok"] if "status" in rows else rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backends", default="cpp")
    ap.add_argument("--multipliers", default="mul8*", help="sweep.multipliers (a glob or [a,b,...])")
    ap.add_argument("--work", default=None, help="where the sweeps' results go (default: a temporary directory)")
    opts, extra = ap.parse_known_args()
    per = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(opts.work or tmp)
        for backend in opts.backends.split(","):
            for mode in MODES:
                per[(backend, mode)] = sweep(mode, backend, opts.checkpoints, work / f"{backend}_{mode}", extra,
                                             opts.multipliers)
    out = []
    for backend in opts.backends.split(","):
        cols = {}
        for mode in MODES:
            df = per[(backend, mode)]
            ap_rows = df[df.path == "approx"].set_index("multiplier")
            fq = df[df.path == "fakequant"]
            cols[f"approx_accuracy_{mode}"] = ap_rows.accuracy
            cols[f"agreement_fakequant_{mode}"] = ap_rows.agreement_fakequant
            # one fake-quant row per signedness (the reference of the signed and of the unsigned tables)
            signed = {m: str(m).startswith("mul8s") for m in ap_rows.index}
            fq_acc = {s: fq[fq.multiplier.astype(str).str.startswith("mul8s") == s].accuracy for s in (True, False)}
            cols[f"fakequant_accuracy_{mode}"] = pd.Series(
                {m: (fq_acc[s].iloc[0] if len(fq_acc[s]) else float("nan")) for m, s in signed.items()})
        table = pd.DataFrame(cols)
        table["approx_delta_points"] = (table.approx_accuracy_integer - table.approx_accuracy_float) * 100
        table["fakequant_delta_points"] = (table.fakequant_accuracy_integer - table.fakequant_accuracy_float) * 100
        table.insert(0, "backend", backend)
        out.append(table.reset_index(names="multiplier"))
    result = pd.concat(out)
    result.to_csv(opts.out, index=False, float_format="%.6g")
    print(result.to_string(index=False))


if __name__ == "__main__":
    main()
