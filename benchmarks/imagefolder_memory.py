"""Host memory of evaluating an ImageNet-sized decoded set read lazily from its on-disk uint8 cache.

    python benchmarks/imagefolder_memory.py [--images 50000] [--size 224] [--batch 250] [--dir /tmp]

Writes a uint8 [N, 3, S, S] .npy memmap as data=imagefolder's cache stores it (sparse: generated, nothing
decoded; --fill writes pseudo-random pixels instead), wraps it as the Dataset's lazily read `Images`, then runs
what compare does with it on the CPU: calibration (runner.quant.calibrate) and a full evaluation pass
(runner.evaluate.run_timed) of a small conv net over every image. A thread samples /proc/self/status every
20 ms; the bar is on the peak of RssAnon (the process's own memory: the memmap's page cache is RssFile and
the kernel's to reclaim). VmHWM is printed too, for comparison: it counts the mapped file pages as well."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakSampler(threading.Thread):
    def __init__(self, every_s: float = 0.02):
        super().__init__(daemon=True)
        self.every_s, self.peak_anon_kb, self.running = every_s, 0, True

    def run(self):
        while self.running:
            self.peak_anon_kb = max(self.peak_anon_kb, status_kb("RssAnon"))
            time.sleep(self.every_s)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak_anon_kb, status_kb("RssAnon"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=50_000)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=250)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--fill", action="store_true", help="write pseudo-random pixels (default: a sparse file)")
    args = p.parse_args()

    from runner.data.dataset import Images
    from runner.evaluate import run_timed
    from runner.quant import QuantConfig, calibrate

    torch.manual_seed(0)
    # small on purpose: the bar is the data path's memory, not the model's
    model = nn.Sequential(nn.Conv2d(3, 8, 8, stride=8), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(128, 1000)).eval()
    path = Path(args.dir) / f"approx-run-memory-{os.getpid()}.npy"
    try:
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8,
                                          shape=(args.images, 3, args.size, args.size))
        if args.fill:
            rng = np.random.default_rng(0)
            for i in range(0, args.images, 1000):
                array[i:i + 1000] = rng.integers(0, 256, array[i:i + 1000].shape, dtype=np.uint8)
        array.flush()
        del array
        x = Images(np.load(path, mmap_mode="r"))
        gb = x.array.nbytes / 1e9
        base_kb = status_kb("RssAnon")
        sampler = PeakSampler()
        sampler.start()
        t0 = time.perf_counter()
        calibrate(model, x, QuantConfig())
        timed = run_timed(model, x, args.batch, torch.device("cpu"), warmup=0, repeats=0)
        elapsed = time.perf_counter() - t0
        peak_kb = sampler.stop()
        assert len(timed.predictions) == args.images
        print(f"{args.images:,} images {args.size}x{args.size} (uint8 cache {gb:.2f} GB, "
              f"{'filled' if args.fill else 'sparse'}), batch {args.batch}: calibration + one evaluation pass "
              f"{elapsed:.1f} s, threads {torch.get_num_threads()}")
        print(f"RssAnon before {base_kb / 1e6:.2f} GB, peak {peak_kb / 1e6:.2f} GB (bar < 3 GB); "
              f"VmHWM {status_kb('VmHWM') / 1e6:.2f} GB (counts the mapped cache's file pages)")
        if peak_kb / 1e6 >= 3.0:
            sys.exit(1)
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
