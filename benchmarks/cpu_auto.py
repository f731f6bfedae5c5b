"""CPU `auto` against the fastest variant, from one or more `approx-run bench --algos` runs.

    approx-run bench --algos 'bench.batches=[1,256,10000]' bench.ops=false bench.model=false \
        bench.layers=false 'bench.backends=[cpp]' bench.repeats=15 bench.warmup=2 bench.threads=2
    python benchmarks/cpu_auto.py RUN_DIR [RUN_DIR ...]   # each holding the run's algos.csv

Per (layer, batch): each variant's median time in every run (bench times a layer's variants in interleaved
rounds), auto's pick per run, and auto's time over the fastest variant's per run and their median over runs
(a busy machine moves single runs).
"""
import statistics
import sys
from pathlib import Path

import pandas as pd


def main(dirs):
    runs = [pd.read_csv(Path(d) / "algos.csv") for d in dirs]
    rows = []
    for (layer, batch), _ in runs[0].groupby(["layer", "batch"], sort=False):
        ratios, picks, times = [], [], {}
        for df in runs:
            g = df[(df.layer == layer) & (df.batch == batch)].set_index("algo")
            best = g.drop(index="auto").median_us.min()
            ratios.append(g.median_us["auto"] / best)
            picks.append(g.auto_pick["auto"])
            for algo, t in g.median_us.items():
                times.setdefault(algo, []).append(t)
        rows.append(dict(layer=layer, batch=batch, **{f"{a}_us": "/".join(f"{t:.0f}" for t in ts)
                                                     for a, ts in times.items()},
                         auto_pick="/".join(picks), auto_over_fastest="/".join(f"{r:.2f}" for r in ratios),
                         median_ratio=round(statistics.median(ratios), 2)))
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
