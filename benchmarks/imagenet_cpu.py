"""Torchvision ImageNet models on the CPU backend (cpp): the converted model beside PyTorch fp32, alternated
in one process, whole model and per layer with the lookup-limit fraction.

    python benchmarks/imagenet_cpu.py --model resnet18 --batch 8 --threads 2 --repeats 7 [--layers]

Random weights (torchvision's architecture, weights=None: the kernels' time does not depend on trained
values), `exact` table in every Conv2d/Linear, inputs 3x224x224 from N(0, 1), scales calibrated on 16
images. Whole model: each repeat times fp32 then the LUT model (wall clock), so a load change on the shared
machine hits both; prints median, min and max of each and of their ratio. The lookup limit is measured in
the same process (runner.bench_layers.lookup_limit). --layers adds runner.bench_layers' per-layer table (one
row per Conv2d/Linear: time, MAC/s, fraction of the limit, auto's variant). APPROX_RUN_CPU_ISA=avx2 runs the
AVX2 kernels on a machine with AVX-512 (the bar's machine has none).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--multiplier", default="exact")
    ap.add_argument("--layers", action="store_true")
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import torchvision

    from runner.layers import approximate, auto_picks

    try:
        from runner.bench_layers import lookup_limit
    except ImportError:  # a tree from before approx::lookup_rate (to time the old kernels beside the new)
        lookup_limit = lambda _device: float("nan")  # noqa: E731

    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(weights=None).eval()
    calib = torch.randn(16, 3, 224, 224)
    x = torch.randn(args.batch, 3, 224, 224)
    _, approx = approximate(model, args.multiplier, calib, backend="cpp")
    limit = lookup_limit("cpu")
    with torch.no_grad():
        approx(x), model(x)  # first calls: auto's trials and table builds
        fp, lut = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter(); model(x); fp.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); approx(x); lut.append(time.perf_counter() - t0)
    ratio = [b / a for a, b in zip(fp, lut)]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"{args.model} batch {args.batch} 224x224, {args.multiplier}, {args.threads} threads, "
          f"ISA {os.environ.get('APPROX_RUN_CPU_ISA', 'widest')}, {cpu}, torch {torch.__version__}")
    print(f"lookup limit (measured gather loop, {args.threads} threads): {limit / 1e9:.1f} G lookups/s")
    ms = lambda v: f"median {statistics.median(v) * 1e3:.0f} ms (min {min(v) * 1e3:.0f}, max {max(v) * 1e3:.0f})"
    print(f"fp32  {ms(fp)}")
    print(f"LUT   {ms(lut)}")
    print(f"ratio median {statistics.median(ratio):.2f}x (min {min(ratio):.2f}, max {max(ratio):.2f}), "
          f"{args.repeats} alternated repeats")
    print("auto picks:", dict(sorted(__import__("collections").Counter(auto_picks(approx).values()).items())))
    if args.layers:
        from runner.bench_layers import bench_model_layers
        from runner.quant import QuantConfig
        from runner.multipliers import resolve

        df = bench_model_layers(model, resolve(args.multiplier), QuantConfig(), calib, x, ["cpp"],
                                batches=(args.batch,), repeats=3)
        df["limit_fraction"] = df.macs / (df.median_us * 1e-6) / limit
        cols = ["layer", "kind", "in_channels", "out_channels", "kernel", "stride", "input_shape", "macs",
                "median_us", "gmacs", "fp32_median_us", "x_fp32_time", "limit_fraction", "auto_pick"]
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        if args.csv:
            df.to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
