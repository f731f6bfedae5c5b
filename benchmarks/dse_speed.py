"""Wall and CPU time of the exploration commands, baseline trained, nothing recorded yet.

    python benchmarks/dse_speed.py                       # 2-core machine, backend=cpp
    python benchmarks/dse_speed.py --backend cuda        # the H100

Each command runs as a user runs it (a fresh `approx-run` process) into an empty results directory;
the baseline is trained first, untimed, into --checkpoints. CPU time is the child's user + system
time: well above wall time means the torch threads ran in parallel, wall well above CPU means the
process waited (for another job on a shared machine, or for the GPU)."""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMMANDS = {
    "sweep": ["sweep", "sweep.multipliers=mul8*"],
    "sensitivity": ["sensitivity", "sensitivity.multipliers=mul8*"],
    "search": ["search", "search.multipliers=mul8*"],
}


def timed(args: list[str]) -> tuple[float, float, float, int]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"`approx-run {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpp")
    ap.add_argument("--checkpoints", default=str(REPO / "checkpoints"))
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    ap.add_argument("--repeats", type=int, default=1, help="runs per command, each into a fresh results directory")
    args = ap.parse_args()
    ckpt = f"paths.checkpoints={args.checkpoints}"
    common = [f"backend={args.backend}", ckpt]
    with tempfile.TemporaryDirectory() as tmp:
        timed(["train", ckpt, f"paths.results={tmp}/train"])
        print(f"load average before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
        print(f"{'command':<13}{'run':>4}{'wall s':>9}{'user s':>9}{'sys s':>8}")
        for name in args.commands:
            for i in range(args.repeats):
                wall, user, sys_s, _ = timed([*COMMANDS[name], *common, f"paths.results={tmp}/{name}{i}"])
                print(f"{name:<13}{i:>4}{wall:>9.2f}{user:>9.2f}{sys_s:>8.2f}")


if __name__ == "__main__":
    main()
