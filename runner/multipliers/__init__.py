"""Approximate 8x8 multipliers as 256x256 look-up tables.

Table layout: torch.int32 [256, 256], row = operand A (activation), column = operand B
(weight); signed: A = row - 128, B = col - 128; unsigned: A = row, B = col. See core.py for
the sha256 definition, metrics.py for the error metrics (metrics_of(m)), families.py for the generated
designs, registry.py for config specs and user imports.
"""

from .core import Multiplier, exact_table, table_sha256
from .families import build as build_family
from .io import save_table
from .peers import load_table
from .metrics import compute_metrics, metrics_of
from .registry import get, import_table, list_multipliers, manifest, resolve, resolve_per_layer, user_dir

__all__ = [
    "Multiplier", "exact_table", "table_sha256", "build_family", "load_table", "save_table",
    "compute_metrics", "metrics_of", "get", "import_table", "list_multipliers", "manifest", "resolve",
    "resolve_per_layer", "user_dir",
]
