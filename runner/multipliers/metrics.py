"""Error metrics of a multiplier over all 65,536 operand pairs.

err = table - exact product. Percentages follow EvoApproxLib: MAE% and WCE% are relative to
2^16 (for signed multipliers too), EP% is the share of pairs with any error, MRE% and WCRE%
average/maximise |err| / |exact| over the pairs whose exact product is non-zero.

EvoApproxLib prints MAE rounded in each circuit's header and, for most circuits, derives its
published MAE% from that rounded value (mul8s_1KV8: MAE 1.25 -> "1.2" -> 0.0018 %, while
1.25 / 2^16 = 0.0019 %). `published_convention` reproduces that; `compute_metrics` (and
`metrics_of`, its cached form for a Multiplier) report the unrounded figures.
"""

from __future__ import annotations

import re

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


def within_rounding(value: float, text: str) -> bool:
    """value rounds to the printed text (its mantissa digits and exponent, e.g. "0.88", "42811.074e3")."""
    m = re.fullmatch(r"[-+]?([0-9]*)\.?([0-9]*)(?:[eE]([-+]?[0-9]+))?", str(text).strip())
    if not m or not (m.group(1) or m.group(2)):
        return False
    unit = 10.0 ** (int(m.group(3) or 0) - len(m.group(2)))
    return abs(value - float(text)) <= unit / 2 * (1 + 1e-9) + 1e-12


def published_convention(metrics: dict, published: dict | None = None) -> dict:
    """Our metrics as EvoApproxLib computes its published figures (keys like the manifest).

    Its MAE% derives from the MAE the header prints, rounded (1.25 -> "1.2", 0.875 -> "0.88"), for most
    circuits and from the unrounded MAE for others (mul8u_874: MAE 37.035, printed "37", MAE% "0.057" =
    37.035 / 2^16, while 37 / 2^16 = 0.056 %). Given
    the published figures, the reading that reproduces them is used; without, MAE rounded to 0.1."""
    mae_pct = round(metrics["mae"], 1) / TWO16 * 100.0   # round() is half-to-even, like printf("%.1f")
    if published:
        text, pub_mae = str(published.get("mae%", "")), published.get("mae")
        if pub_mae is not None and within_rounding(metrics["mae"], pub_mae):
            mae_pct = float(pub_mae) / TWO16 * 100.0
        if text and not matches_published(mae_pct, text) and matches_published(metrics["mae_pct"], text):
            mae_pct = metrics["mae_pct"]
    return {
        "mae%": mae_pct,
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
