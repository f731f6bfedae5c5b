"""Error metrics of a multiplier over all 65,536 operand pairs.

err = table - exact product. Percentages follow EvoApproxLib: MAE% and WCE% are relative to
2^16 (for signed multipliers too), EP% is the share of pairs with any error, MRE% and WCRE%
average/maximise |err| / |exact| over the pairs whose exact product is non-zero.

EvoApproxLib prints MAE rounded to one decimal in each circuit's header and derives its
published MAE% from that rounded value (mul8s_1KV8: MAE 1.25 -> "1.2" -> 0.0018 %, while
1.25 / 2^16 = 0.0019 %). `published_convention` reproduces that; `compute_metrics` (and
`metrics_of`, its cached form for a Multiplier) report the unrounded figures.
"""

from __future__ import annotations

import numpy as np
import torch

from .core import TWO16, Multiplier, exact_table

KEYS = ("mae", "mae_pct", "wce", "wce_pct", "ep_pct", "mre_pct", "wcre_pct", "mean_error",
        "error_std", "mse")


def compute_metrics(lut, signed: bool) -> dict:
    table = lut.numpy() if isinstance(lut, torch.Tensor) else np.asarray(lut)
    exact = exact_table(signed)
    err = table.astype(np.int64) - exact
    ae = np.abs(err)
    nz = exact != 0
    rel = ae[nz] / np.abs(exact[nz])
    mae = float(ae.mean())
    wce = int(ae.max())
    return {
        "mae": mae,
        "mae_pct": mae / TWO16 * 100.0,
        "wce": wce,
        "wce_pct": wce / TWO16 * 100.0,
        "ep_pct": float(np.count_nonzero(err)) / err.size * 100.0,
        "mre_pct": float(rel.mean()) * 100.0,
        "wcre_pct": float(rel.max()) * 100.0,
        "mean_error": float(err.mean()),
        "error_std": float(err.std()),
        "mse": float((err.astype(np.float64) ** 2).mean()),
    }


def published_convention(metrics: dict) -> dict:
    """Our metrics as EvoApproxLib computes its published figures (keys like the manifest)."""
    # round() is half-to-even on the exact binary value, like C's printf("%.1f").
    return {
        "mae%": round(metrics["mae"], 1) / TWO16 * 100.0,
        "wce%": metrics["wce_pct"],
        "ep%": metrics["ep_pct"],
        "mre%": metrics["mre_pct"],
        "wcre%": metrics["wcre_pct"],
    }


def matches_published(value: float, published: str) -> bool:
    """True when value, shown with the published string's number of decimals, equals it."""
    decimals = len(published.split(".")[1]) if "." in published else 0
    return f"{value:.{decimals}f}" == published.strip()


_CACHE: dict[tuple[str, bool], dict] = {}


def metrics_of(m: Multiplier) -> dict:
    """compute_metrics of a Multiplier, computed once per table (by its sha256); a copy the caller may change."""
    key = (m.sha256, m.signed)
    if key not in _CACHE:
        _CACHE[key] = compute_metrics(m.lut, m.signed)
    return dict(_CACHE[key])
