"""Time to evaluate each EvoApproxLib circuit (C model and Verilog netlist) on all 65,536 operand pairs.

    python benchmarks/circuit_import.py [SOURCES] [--repeats 5]

Per file: one warm-up, then the median of --repeats runs of circuits.load_circuit (read, parse,
evaluate, validate; what `lut import` does before registering). The evaluator is numpy on packed
bits, single-threaded; the process's thread settings are printed for the record."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runner.multipliers.circuits import load_circuit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("sources", nargs="?", default=str(REPO.parent / "shared" / "evoapprox" / "v2022"))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    files = sorted(Path(args.sources).glob("mul8*.[cv]"))
    if not files:
        sys.exit(f"no circuits in {args.sources}")
    print(f"# {len(files)} files, warm-up + median of {args.repeats}; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, cpus {os.cpu_count()}")
    medians = {}
    for f in files:
        load_circuit(f)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            load_circuit(f)
            times.append(time.perf_counter() - t)
        medians[f.name] = statistics.median(times)
    for ext in (".c", ".v"):
        ts = sorted((v, k) for k, v in medians.items() if k.endswith(ext))
        print(f"{ext}: median over files {statistics.median(t for t, _ in ts) * 1000:.1f} ms, "
              f"fastest {ts[0][0] * 1000:.1f} ms ({ts[0][1]}), slowest {ts[-1][0] * 1000:.1f} ms ({ts[-1][1]})")


if __name__ == "__main__":
    main()
