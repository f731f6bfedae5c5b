"""GPU timings of approx::lut_conv2d / approx::lut_linear on the LeNet-5 layer shapes.

    python benchmarks/cuda_layers.py [--batch 10000] [--repeat 30] [--out FILE.json]
        [--algos A,B,...] [--layers fc2,fc3,...]

Per layer, data kind (uniform random codes; ReLU-like: half zeros) and algo: median of `repeat`
timings with CUDA events after warm-up, rotating among 3 input sets so that repeats do not run
from a warm L2. Each timing covers one call as a model's forward makes it: with the prepared
tables cached per (weights, LUT) that is the kernel alone; run with APPROX_RUN_TABLE_CACHE=0 to
time every call's prep and table build too.
Then the five layers back to back with the `auto` choice, plain and replayed from a CUDA graph.
Needs the CUDA build of runner._C; no Hydra.
"""
import argparse
import json
import statistics

import torch

from runner.bench import LENET5_LAYERS, device_timer
from runner.multipliers.core import exact_lut

# name: (kind, a shape per image, w shape)
LAYERS = {name: (kind, ashape, wshape) for name, kind, ashape, wshape in LENET5_LAYERS}


def macs(name, batch):
    kind, ashape, wshape = LAYERS[name]
    if kind == "conv":
        ho, wo = ashape[1] - wshape[2] + 1, ashape[2] - wshape[3] + 1
        return batch * ho * wo * wshape[0] * wshape[1] * wshape[2] * wshape[3]
    return batch * wshape[0] * wshape[1]


def codes(shape, data, gen):
    # unsigned codes, as after ReLU; "uniform" draws all 256 codes, "relu" zeroes half of them
    a = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device="cuda")
    if data == "relu":
        a[torch.rand(shape, generator=gen, device="cuda") < 0.5] = 0
    return a


def call(name, a, w, lut, algo):
    if LAYERS[name][0] == "conv":
        return torch.ops.approx.lut_conv2d(a, w, lut, [1, 1], [0, 0], [1, 1], 1, algo)
    return torch.ops.approx.lut_linear(a, w, lut, algo)


def time_ms(fn, inputs, repeat, warmup=3, queued=True):
    """Median, min and max ms of fn over the rotating inputs (queued: see device_timer)."""
    timer = device_timer(torch.device("cuda"), queued)
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = [timer(lambda: fn(inputs[i % len(inputs)])) / 1e3 for i in range(repeat)]
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--algos", default=None, help="default: every variant the kernels list, and auto")
    ap.add_argument("--layers", default=",".join(LAYERS), help="layers to time one by one")
    ap.add_argument("--profile", action="store_true", help="print a kernel time breakdown")
    ap.add_argument("--five-algo", default="auto", help="algo of the five-layer runs")
    args = ap.parse_args()
    import runner._C  # noqa: F401
    from runner.ops import backend_algos

    args.algos = args.algos or ",".join((*backend_algos("cuda"), "auto"))

    gen = torch.Generator(device="cuda").manual_seed(0)
    # exact unsigned 8x8 products (fit int16, so the int16 paths run)
    lut = exact_lut(signed=False).to("cuda")
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}")
    print(f"{'layer':6} {'data':8} {'algo':17} {'median ms':>10} {'T MAC/s':>8} {'min ms':>8} "
          f"{'call ms':>8}")
    for data in ("uniform", "relu"):
        seqs = {}
        for name, (kind, ashape, wshape) in LAYERS.items():
            w = torch.randint(-127, 128, wshape, generator=gen, dtype=torch.int8, device="cuda")
            inputs = [codes((args.batch, *ashape), data, gen) for _ in range(3)]
            seqs[name] = (w, inputs)
            for algo in args.algos.split(",") if name in args.layers.split(",") else []:
                try:
                    call(name, inputs[0], w, lut, algo)
                except RuntimeError:  # a variant that does not run this shape
                    continue
                med, lo, _ = time_ms(lambda a: call(name, a, w, lut, algo), inputs, args.repeat)
                call_ms, _, _ = time_ms(lambda a: call(name, a, w, lut, algo), inputs, args.repeat,
                                        queued=False)
                tmacs = macs(name, args.batch) / (med * 1e-3) / 1e12
                rows.append(dict(layer=name, data=data, algo=algo, median_ms=med, min_ms=lo,
                                 call_ms=call_ms, tmacs=tmacs, macs=macs(name, args.batch)))
                print(f"{name:6} {data:8} {algo:17} {med:10.4f} {tmacs:8.2f} {lo:8.4f} {call_ms:8.4f}",
                      flush=True)

        def five(i):
            for name in LAYERS:
                w, inputs = seqs[name]
                call(name, inputs[i % 3], w, lut, args.five_algo)

        med, lo, _ = time_ms(five, [0, 1, 2], args.repeat)
        total = sum(macs(n, args.batch) for n in LAYERS)
        rows.append(dict(layer="all5", data=data, algo="auto", median_ms=med, min_ms=lo,
                         tmacs=total / (med * 1e-3) / 1e12))
        idle, _, _ = time_ms(five, [0, 1, 2], args.repeat, queued=False)
        rows[-1]["call_ms"] = idle
        print(f"{'all5':6} {data:8} {'auto':17} {med:10.4f} {total / med / 1e9:8.2f} {lo:8.4f} {idle:8.4f}")
        if args.profile and data == "uniform":  # kernel time breakdown of the five layers
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(3):
                    five(i)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                            max_name_column_width=60))
        # the same from a CUDA graph (launch gaps removed)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            five(0)
        torch.cuda.current_stream().wait_stream(s)
        graphs = []
        for i in range(3):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                five(i)
            graphs.append(g)
        med, lo, _ = time_ms(lambda g: g.replay(), graphs, args.repeat)
        rows.append(dict(layer="all5-graph", data=data, algo="auto", median_ms=med, min_ms=lo,
                         tmacs=total / (med * 1e-3) / 1e12))
        print(f"{'all5g':6} {data:8} {'auto (graph)':17} {med:10.4f} {total / med / 1e9:8.2f} {lo:8.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           batch=args.batch, repeat=args.repeat, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
