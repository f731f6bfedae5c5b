"""How well each error metric ranks the multipliers by the accuracy they lose: Spearman rank correlation
of the metric with (fake-quant accuracy - approx accuracy) over the uniform rows of a sweep.

    approx-run sweep sweep.multipliers='mul8*'
    python benchmarks/dse_spearman.py results/sweep/<date>_<time>     # prints a markdown table

Each job of the sweep is paired with its own fake-quant reference (same data, quant scheme and
signedness), as the sweep's summary.csv records it. Each rho comes with a 95 % bootstrap confidence
interval (multipliers resampled with replacement, `--resamples` times, seeded): with a few dozen tables
and one-image accuracy differences between close ones, a single rho is not a ranking claim; only
intervals that do not overlap are."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

METRICS = {
    "mult_mae_pct": "MAE % (uniform over all operand pairs)",
    "mult_wce_pct": "WCE % (uniform)",
    "mult_error_std": "error std (uniform)",
    "op_mae_pct": "operand-aware MAE % of a product",
    "op_error_std": "operand-aware error std of a product",
    "op_acc_nrmse": "operand-aware predicted accumulator error / accumulator rms",
}


def losses(sweep_dir: Path, results: Path) -> pd.DataFrame:
    """One row per ok job of the sweep: its accuracy loss against its fake-quant reference (from the
    sweep's summary) and its metrics (from its results row, found by row key)."""
    summary = pd.read_csv(sweep_dir / "summary.csv")
    summary = summary[summary["status"].isin(["ok", "skipped"])]
    rows = pd.read_csv(results).drop_duplicates("row_key", keep="last").set_index("row_key")
    table = summary[["multiplier", "row_key", "accuracy", "fakequant_accuracy"]].copy()
    table["loss_pts"] = 100 * (table["fakequant_accuracy"] - table["accuracy"])
    for col in METRICS:
        table[col] = table["row_key"].map(rows[col]) if col in rows else None
    return table


def spearman_ci(loss: np.ndarray, metric: np.ndarray, resamples: int, seed: int = 0) -> tuple[float, float, float]:
    """rho and its 95 % percentile bootstrap interval; resamples where either side is constant are dropped
    (rho is undefined there)."""
    def rho(a, b):
        ra, rb = pd.Series(a).rank().to_numpy(), pd.Series(b).rank().to_numpy()
        if ra.std() == 0 or rb.std() == 0:
            return np.nan
        return float(np.corrcoef(ra, rb)[0, 1])

    rng = np.random.default_rng(seed)
    n = len(loss)
    boots = np.array([rho(loss[i], metric[i]) for i in (rng.integers(0, n, n) for _ in range(resamples))])
    boots = boots[~np.isnan(boots)]
    lo, hi = np.percentile(boots, [2.5, 97.5]) if len(boots) else (np.nan, np.nan)
    return rho(loss, metric), float(lo), float(hi)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path, help="the sweep's directory (holds summary.csv)")
    ap.add_argument("--results", type=Path, default=None,
                    help="the results file it wrote to (default: <paths.results>/results.csv above the sweep dir)")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    args = ap.parse_args()
    table = losses(args.sweep_dir, args.results or args.sweep_dir.parent.parent / "results.csv")
    if len(table) < 3:
        print(f"{args.sweep_dir}: {len(table)} finished jobs; need at least 3", file=sys.stderr)
        return 2
    print(f"{len(table)} multipliers; accuracy loss from {table['loss_pts'].min():.1f} to "
          f"{table['loss_pts'].max():.1f} points\n")
    print("| metric | Spearman rho with accuracy loss | 95 % bootstrap CI |\n|---|---:|---|")
    for col, text in METRICS.items():
        if col in table and table[col].notna().sum() >= 3:
            known = table[table[col].notna()]
            rho, lo, hi = spearman_ci(known["loss_pts"].to_numpy(float), known[col].to_numpy(float), args.resamples)
            print(f"| `{col}`: {text} | {rho:.3f} | [{lo:.2f}, {hi:.2f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
