"""Do two sweeps of the same tables on different backends or devices give the same predictions?
Compares the accuracy and the agreement with fake-quant of every job in two sweeps' summary.csv files,
keyed by multiplier, and prints each difference (exit 1 if any).

    approx-run sweep sweep.multipliers='mul8*' backend=cpp  paths.results=A paths.checkpoints=CK
    approx-run sweep sweep.multipliers='mul8*' backend=cuda paths.results=B paths.checkpoints=CK
    python benchmarks/backend_agreement.py A/sweep/<date>_<time> B/sweep/<date>_<time>"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

COLUMNS = ("accuracy", "fakequant_accuracy", "agreement_fakequant")


def jobs(sweep_dir: Path) -> dict[str, dict]:
    with open(sweep_dir / "summary.csv", newline="") as f:
        return {r["multiplier"]: r for r in csv.DictReader(f) if r.get("status") in ("ok", "skipped")}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = (jobs(Path(d)) for d in argv)
    common = sorted(set(a) & set(b))
    columns = [c for c in COLUMNS if c in next(iter(a.values()), {})]
    differ = [(m, c, a[m][c], b[m][c]) for m in common for c in columns if float(a[m][c]) != float(b[m][c])]
    for m, c, x, y in differ:
        print(f"{m}: {c} {x} vs {y}")
    only = sorted(set(a) ^ set(b))
    print(f"{len(common)} tables in both ({', '.join(columns)} compared), {len(differ)} differences"
          + (f"; only in one sweep: {', '.join(only)}" if only else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
