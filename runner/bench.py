"""Benchmarks. Op level (this part): every LeNet-5 layer shape through each LUT backend.

`bench_ops` times the approx ops alone on synthetic codes, one row per (backend, algo, layer,
batch, code distribution): min / median / mean microseconds over `repeats` calls after `warmup`
calls, the first (cold) call separately (it includes any per-weight setup such as the CPU
expanded table, which later calls reuse), and GMAC/s from the median.
"""
from __future__ import annotations

import statistics
import time

import pandas as pd
import torch

from runner import ops

# LeNet-5 layers as the approx ops see them: name, kind, activation shape without batch, weight shape.
LENET5_LAYERS = (
    ("conv1", "conv", (1, 28, 28), (6, 1, 5, 5)),
    ("conv2", "conv", (6, 12, 12), (16, 6, 5, 5)),
    ("fc1", "linear", (256,), (120, 256)),
    ("fc2", "linear", (120,), (84, 120)),
    ("fc3", "linear", (84,), (10, 84)),
)

DEFAULT_ALGOS = {"python": ("auto",), "cpp": ("direct", "expanded"), "cuda": ("auto",)}
DISTRIBUTIONS = ("uniform", "relu")


def layer_macs(kind, a_shape, w_shape, batch):
    if kind == "linear":
        return batch * w_shape[0] * w_shape[1]
    ho = a_shape[1] - w_shape[2] + 1
    wo = a_shape[2] - w_shape[3] + 1
    return batch * w_shape[0] * ho * wo * w_shape[1] * w_shape[2] * w_shape[3]


def exact_lut(signed: bool) -> torch.Tensor:
    """The exact 8-bit multiplier in the op's LUT layout (what the timings use by default)."""
    i = torch.arange(256, dtype=torch.int32)
    return (i - 128)[:, None] * (i - 128)[None, :] if signed else i[:, None] * i[None, :]


def synthetic_codes(shape, signed, dist, gen):
    """'uniform': every code equally likely; 'relu': half the codes 0 (post-ReLU activations)."""
    if signed:
        a = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    else:
        a = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if dist == "relu":
        a = a.abs() if signed else a
        a[torch.rand(shape, generator=gen) < 0.5] = 0
    elif dist != "uniform":
        raise ValueError(f"unknown code distribution '{dist}'; valid: {', '.join(DISTRIBUTIONS)}")
    return a


def _timer(device):
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) * 1e3  # ms -> us
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
    return run


def bench_ops(backends=("python", "cpp"), batches=(1, 256, 10000), repeats=20, warmup=3, *,
              algos=None, distributions=DISTRIBUTIONS, signed=False, lut=None, layers=None,
              python_max_macs=20_000_000, python_repeats=2, seed=0) -> pd.DataFrame:
    """Time each LeNet-5 layer shape per backend; returns one row per measurement.

    backends: "python" (reference), "cpp", "cuda" (tensors on the current CUDA device).
    algos: {backend: names}; defaults to DEFAULT_ALGOS. lut: int32 [256, 256] (default: exact).
    The python reference is slow: it runs only where the layer has at most `python_max_macs`
    MACs, with at most `python_repeats` repeats and one warm-up call.
    """
    algos = {**DEFAULT_ALGOS, **(algos or {})}
    lut = exact_lut(signed) if lut is None else lut
    layers = [l for l in LENET5_LAYERS if layers is None or l[0] in layers]
    rows = []
    for backend in backends:
        device = torch.device("cuda" if backend == "cuda" else "cpu")
        timer = _timer(device)
        lut_d = lut.to(device)
        for name, kind, a_shape, w_shape in layers:
            for batch in batches:
                macs = layer_macs(kind, a_shape, w_shape, batch)
                reps, warm = repeats, warmup
                if backend == "python":
                    if macs > python_max_macs:
                        continue
                    reps, warm = min(repeats, python_repeats), min(warmup, 1)
                for dist in distributions:
                    gen = torch.Generator().manual_seed(seed)
                    a = synthetic_codes((batch, *a_shape), signed, dist, gen).to(device)
                    w = torch.randint(-127, 128, w_shape, generator=gen, dtype=torch.int8).to(device)
                    for algo in algos.get(backend, ("auto",)):
                        if kind == "conv":
                            fn = lambda: ops.lut_conv2d(a, w, lut_d, backend=backend, algo=algo)  # noqa: E731
                        else:
                            fn = lambda: ops.lut_linear(a, w, lut_d, backend=backend, algo=algo)  # noqa: E731
                        first = timer(fn)
                        for _ in range(warm):
                            timer(fn)
                        ts = [timer(fn) for _ in range(reps)]
                        med = statistics.median(ts)
                        rows.append(dict(
                            backend=backend, algo=algo, layer=name, batch=batch, dist=dist,
                            signed=signed, device=str(device), threads=torch.get_num_threads(),
                            repeats=reps, macs=macs, first_us=first, min_us=min(ts),
                            median_us=med, mean_us=statistics.fmean(ts),
                            gmacs=macs / med / 1e3 if med > 0 else float("nan"),
                        ))
    return pd.DataFrame(rows)
