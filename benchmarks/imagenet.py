"""Torchvision ImageNet models through the LUT kernels, beside PyTorch fp32, alternated in one process:
whole model and per layer, with the fraction of the lookup limit.

    python benchmarks/imagenet.py --model resnet18 --batch 8 --threads 2 --repeats 7 [--layers]      # cpp
    python benchmarks/imagenet.py --backend cuda --model resnet50 --batch 64 --repeats 10 --layers   # GPU

Random weights (torchvision's architecture, weights=None: the kernels' time does not depend on trained
values), one table (`--multiplier`, default exact) in every Conv2d/Linear, inputs 3x224x224 from N(0, 1),
scales calibrated on 16 images. Whole model: each repeat times fp32 then the LUT model (CPU: wall clock and
the process's CPU time; cuda: CUDA events, runner.evaluate.device_timer; fp32 with TF32 off and, on the
GPU, also on), so a load change on a shared machine hits both; prints median, min and max of each and of
the ratio. The lookup limit: runner.bench_layers.lookup_limit (CPU: measured in this process).
--layers adds runner.bench_layers' per-layer table (time, MAC/s, limit fraction, auto's variant).
--graph (GPU) also times fp32 with TF32 off and the LUT model replayed from CUDA graphs (runner.graphs, as
compare's timed passes run with eval.cuda_graph): at small batches the host's per-layer work, not the
kernels, sets the eager times.
APPROX_RUN_CPU_ISA=avx2 runs the AVX2 kernels on a machine with AVX-512.
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--backend", default="cpp", choices=["cpp", "cuda"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--multiplier", default="exact")
    ap.add_argument("--layers", action="store_true")
    ap.add_argument("--graph", action="store_true", help="also fp32 (TF32 off) and LUT replayed from CUDA graphs")
    ap.add_argument("--csv", default="", help="per-layer table to this CSV (with --layers)")
    ap.add_argument("--variants", action="store_true",
                    help="instead: every variant of the backend on each distinct conv shape of the model (op level)")
    ap.add_argument("--algos", default="", help="with --variants: comma-separated variants (default: all, and auto)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.variants:
        return variants(args)

    import torchvision

    from runner.evaluate import device_timer
    from runner.layers import approximate, auto_picks

    try:
        from runner.bench_layers import lookup_limit
    except ImportError:  # a tree from before approx::lookup_rate (to time the old kernels beside the new)
        lookup_limit = lambda _device: float("nan")  # noqa: E731

    dev = torch.device("cuda" if args.backend == "cuda" else "cpu")
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(weights=None).eval()
    calib = torch.randn(16, 3, 224, 224)
    x = torch.randn(args.batch, 3, 224, 224)
    _, approx = approximate(model, args.multiplier, calib, backend=args.backend)
    model, approx, xd = model.to(dev), approx.to(dev), x.to(dev)
    limit = lookup_limit(dev)
    timer = device_timer(dev)
    paths = {"fp32": lambda: model(xd), "LUT": lambda: approx(xd)}
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        paths = {"fp32 TF32 off": lambda: model(xd), "fp32 TF32 on": lambda: model(xd), "LUT": lambda: approx(xd)}
        if args.graph:
            from runner.graphs import GraphedForward

            graphs = {"fp32 TF32 off graph": GraphedForward(model), "LUT graph": GraphedForward(approx)}
            paths.update({k: (lambda g=g: g(xd)) for k, g in graphs.items()})
    ms, cpu = collections.defaultdict(list), collections.defaultdict(list)
    with torch.no_grad():
        for name, fn in paths.items():  # first calls: auto's trials, table builds, cuDNN's search, the captures
            torch.backends.cudnn.allow_tf32 = not name.startswith("fp32 TF32 off")
            fn(), fn()
        for _ in range(args.repeats):
            for name, fn in paths.items():
                torch.backends.cudnn.allow_tf32 = not name.startswith("fp32 TF32 off")
                c0 = time.process_time()
                ms[name].append(timer(fn) / 1e3)
                cpu[name].append((time.process_time() - c0) * 1e3)
    torch.backends.cudnn.allow_tf32 = True
    ref = "fp32" if dev.type == "cpu" else "fp32 TF32 off"
    ratio = [b / a for a, b in zip(ms[ref], ms["LUT"])]
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
            next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                 platform.processor()))
    print(f"{args.model} batch {args.batch} 3x224x224, {args.multiplier}, backend {args.backend}, {name}, "
          f"{args.threads} threads, ISA {os.environ.get('APPROX_RUN_CPU_ISA') or 'widest'}, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"lookup limit: {limit / 1e9:.1f} G reads/s")
    for k in paths:
        v = ms[k]
        extra = f", CPU time median {statistics.median(cpu[k]):.0f} ms" if dev.type == "cpu" else ""
        print(f"{k:14s} median {statistics.median(v):8.2f} ms (min {min(v):.2f}, max {max(v):.2f}){extra}")
    macs = sum(m.weight[0].numel() * o for m, o in _out_numels(model, xd))
    lut_med = statistics.median(ms["LUT"])
    print(f"ratio LUT / {ref}: median {statistics.median(ratio):.2f}x (min {min(ratio):.2f}, max {max(ratio):.2f}), "
          f"{args.repeats} alternated repeats; {macs / 1e9:.2f} G MACs converted, {macs / lut_med / 1e6:.2f} G MAC/s"
          f" over the LUT model's time = {macs / (lut_med / 1e3) / limit:.2f} of the lookup limit")
    if dev.type == "cpu":  # a loaded machine stretches wall time; per CPU-second of the threads it is fairer
        per_thread = limit / args.threads
        print(f"per CPU second: {macs / statistics.median(cpu['LUT']) / 1e6:.2f} G MAC/s = "
              f"{macs / (statistics.median(cpu['LUT']) / 1e3) / per_thread:.2f} of one thread's lookup limit")
    if "LUT graph" in ms:
        g = [b / a for a, b in zip(ms["fp32 TF32 off graph"], ms["LUT graph"])]
        print(f"ratio LUT graph / fp32 TF32 off graph: median {statistics.median(g):.2f}x (min {min(g):.2f}, max "
              f"{max(g):.2f}); {macs / statistics.median(ms['LUT graph']) / 1e6:.2f} G MAC/s over the graphed LUT "
              f"model's time")
    print("auto picks:", dict(sorted(collections.Counter(auto_picks(approx).values()).items())))
    if args.layers:
        from runner.bench_layers import bench_model_layers
        from runner.multipliers import resolve
        from runner.quant import QuantConfig

        df = bench_model_layers(model.cpu(), resolve(args.multiplier), QuantConfig(), calib, x, [args.backend],
                                batches=(args.batch,), repeats=3 if dev.type == "cpu" else 10)
        cols = ["layer", "kind", "in_channels", "out_channels", "kernel", "stride", "input_shape", "macs",
                "median_us", "gmacs", "fp32_median_us", "x_fp32_time", "limit_fraction", "auto_pick"]
        print(df[[c for c in cols if c in df.columns]].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        if args.csv:
            df.to_csv(args.csv, index=False)


def variants(args) -> None:
    """Each variant of the backend (and auto, after its first call) on every distinct Conv2d shape of the
    model at --batch: random codes (uint8, the `exact` unsigned table), op alone; wall and CPU time (CPU:
    the process's, both threads) of the median of --repeats calls after one warm-up call, and the fraction
    of the lookup limit per CPU-second (CPU) or per second (GPU)."""
    import torchvision

    from runner import ops
    from runner.bench_layers import layer_inputs, lookup_limit
    from runner.evaluate import device_timer
    from runner.multipliers.core import exact_lut

    dev = torch.device("cuda" if args.backend == "cuda" else "cpu")
    model = getattr(torchvision.models, args.model)(weights=None).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        inputs = layer_inputs(model, torch.zeros(args.batch, 3, 224, 224))
    convs = [(modules[name], x) for name, x in inputs.items() if isinstance(modules[name], torch.nn.Conv2d)]
    shapes = dict.fromkeys((tuple(x.shape), tuple(m.weight.shape), m.stride, m.padding, m.groups) for m, x in convs)
    limit, timer = lookup_limit(dev), device_timer(dev)
    per = limit / args.threads if dev.type == "cpu" else limit
    lut = exact_lut(signed=False).to(dev)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.model} batch {args.batch}, backend {args.backend}, {args.threads} threads, ISA "
          f"{os.environ.get('APPROX_RUN_CPU_ISA') or 'widest'}, load {os.getloadavg()[0]:.1f}, "
          f"limit {limit / 1e9:.1f} G reads/s")
    print(f"{'input':>16s} {'weight':>16s} s  {'algo':9s} {'wall ms':>9s} {'cpu ms':>9s} {'GMAC/cpu-s':>10s} {'frac':>5s}")
    for (ashape, wshape, stride, padding, groups) in shapes:
        a = torch.randint(0, 256, ashape, generator=gen, dtype=torch.uint8).to(dev)
        w = torch.randint(-127, 128, wshape, generator=gen, dtype=torch.int8).to(dev)
        for algo in (args.algos.split(",") if args.algos else (*ops.backend_algos(args.backend), "auto")):
            call = lambda: ops.lut_conv2d(a, w, lut, stride, padding, 1, groups, backend=args.backend, algo=algo)  # noqa: E731
            try:
                out = call()
            except Exception as exc:  # noqa: BLE001  (a variant that cannot run the shape says why)
                print(f"{str(ashape):>16s} {str(wshape):>16s} {stride[0]}  {algo:9s} n/a: {str(exc)[:60]}")
                continue
            macs = out.numel() * w[0].numel()
            wall, cpu = [], []
            for _ in range(args.repeats):
                c0 = time.process_time()
                wall.append(timer(call) / 1e3)
                cpu.append((time.process_time() - c0) * 1e3)
            c = statistics.median(cpu) if dev.type == "cpu" else statistics.median(wall)
            rate = macs / (c / 1e3)
            print(f"{str(ashape):>16s} {str(wshape):>16s} {stride[0]}  {algo:9s} {statistics.median(wall):9.1f} "
                  f"{statistics.median(cpu):9.1f} {rate / 1e9:10.2f} {rate / per:5.2f}")


def _out_numels(model, x):
    """(Conv2d/Linear, its output's numel) for one forward over x."""
    from runner.quant import quant_layers

    seen, hooks = [], []
    for m in quant_layers(model).values():
        hooks.append(m.register_forward_hook(lambda mod, _i, out: seen.append((mod, out.numel()))))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


if __name__ == "__main__":
    main()
