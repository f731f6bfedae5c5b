"""CPU `auto` against the fastest variant, from one or more `approx-run bench --algos` runs.

    approx-run bench --algos 'bench.batches=[1,256,10000]' bench.ops=false bench.model=false \
        bench.train=false 'bench.backends=[cpp]' bench.repeats=5 bench.warmup=1 bench.threads=2
    python benchmarks/cpu_auto.py RUN_DIR [RUN_DIR ...]   # each holding the run's algos.csv

Per (layer, batch): each variant's median time in every run, auto's pick per run, and auto's time
over the fastest variant's per run and their median over runs (a busy machine moves single runs).

    python benchmarks/cpu_auto.py --interleaved THREADS ROUNDS BATCH [BATCH ...]

times auto, direct and expanded in turn (round-robin, so a busy spell hits all three alike) on each
LeNet-5 layer, each with its own copy of the weights, after two untimed calls; medians of ROUNDS.
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


def interleaved(threads, rounds, batches):
    import time

    import torch

    from runner import ops
    from runner.bench import LENET5_LAYERS, synthetic_codes
    from runner.multipliers.core import exact_lut

    torch.set_num_threads(threads)
    lut = exact_lut(False)
    print(f"threads={threads} rounds={rounds}\n| layer | batch | auto_us | direct_us | expanded_us | auto_pick | "
          "auto_over_fastest |\n|---|---|---|---|---|---|---|")
    for name, kind, a_shape, w_shape in LENET5_LAYERS:
        for batch in batches:
            gen = torch.Generator().manual_seed(0)
            a = synthetic_codes((batch, *a_shape), False, "uniform", gen)
            w = torch.randint(-127, 128, w_shape, generator=gen, dtype=torch.int8)
            op = ops.lut_conv2d if kind == "conv" else ops.lut_linear
            fns = {algo: (lambda algo=algo, wa=w.clone(): op(a, wa, lut, backend="cpp", algo=algo))
                   for algo in ("auto", "direct", "expanded")}
            for fn in fns.values():
                fn(), fn()
            ts = {algo: [] for algo in fns}
            for _ in range(rounds if batch < 10000 else max(1, rounds // 10)):
                for algo, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    ts[algo].append((time.perf_counter() - t0) * 1e6)
            med = {algo: statistics.median(t) for algo, t in ts.items()}
            pick = next(r["auto_pick_name"] for r in ops.algo_table(a, w, lut, backend="cpp") if r["auto_pick"])
            print(f"| {name} | {batch} | {med['auto']:.0f} | {med['direct']:.0f} | {med['expanded']:.0f} | {pick} | "
                  f"{med['auto'] / min(med['direct'], med['expanded']):.2f} |", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--interleaved":
        interleaved(int(sys.argv[2]), int(sys.argv[3]), [int(b) for b in sys.argv[4:]])
    else:
        main(sys.argv[1:])
