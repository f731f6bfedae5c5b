"""The model zoo on the GPU: every Conv2d/Linear of resnet20, vgg, mobilenetv2 and lenet5 timed through each
CUDA kernel variant, and the whole approx model against the fp32 model (cuDNN) at several batch sizes.

    python benchmarks/zoo_gpu.py [--models resnet20,vgg,mobilenetv2,lenet5,lenet5_classic,lenet5_rgb]
        [--layer-batches 1000,10000] [--model-batches 1,256,1000] [--repeat 20] [--warmup 3]
        [--multiplier exact] [--algos A,B,...] [--profile] [--out PREFIX] [--backend cuda]

Models (random-init weights; speed does not depend on training): resnet20, vgg, mobilenetv2 on 3x32x32;
lenet5 on 1x28x28 (our shapes), lenet5_classic on 1x32x32 (the classic shapes: conv1 on the padded 32x32
image, conv2 on 14x14, fc1 with 400 inputs), lenet5_rgb on 3x32x32. Each model is converted as compare
converts it: BatchNorm and the input normalisation folded, activations calibrated on uniform random images
(per-channel weights, min-max activations), the table of --multiplier in every layer.

Layer rows (PREFIX_layers.csv), per layer and batch, on the input the layer receives inside the model:
  what=kernel  the LUT op alone (approx::lut_conv2d / lut_linear on that input's codes), once per variant the
               kernels list for the shape and once with `auto` (auto_pick: the variant auto chose);
  what=layer   the converted layer's whole forward with auto (quantize, LUT MACs, requantize);
  what=fp32    the same layer in PyTorch fp32 (BatchNorm folded in), cuDNN.
Model rows (PREFIX_models.csv), per model and batch: the approx model (auto), the fp32 model in eval mode with
its BatchNorms (cuDNN defaults, which run convs in TF32; with cudnn.benchmark on; and fp32_strict: TF32 off),
x_fp32 = time / fp32 time (defaults), x_fp32_strict = time / fp32_strict time; on a GPU also each of fp32,
fp32_strict and approx replayed from a CUDA graph (`*_graph`, runner.graphs, as compare's timed passes run), with
x_fp32_graph / x_fp32_strict_graph over the graphed fp32 paths.
Timing: CUDA events (runner.bench.device_timer: a sleep kernel queued first, so the events time the device's
work), `--warmup` calls, median of `--repeat`, rotating among 3 input sets so repeats do not run from a warm
L2; prepared tables cached per (weights, LUT), as in a model's forward.
--backend cpp runs the same on the CPU (a check of the script where there is no GPU; timings meaningless).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runner.bench import device_timer  # noqa: E402
from runner.graphs import GraphedForward  # noqa: E402
from runner.bench_layers import layer_geometry, layer_inputs  # noqa: E402

# name: (zoo model, input channels, image size)
MODELS = {
    "resnet20": ("resnet20", 3, 32),
    "vgg": ("vgg", 3, 32),
    "mobilenetv2": ("mobilenetv2", 3, 32),
    "resnet8": ("resnet8", 1, 28),
    "lenet5": ("lenet5", 1, 28),
    "lenet5_classic": ("lenet5", 1, 32),
    "lenet5_rgb": ("lenet5", 3, 32),
}


def build(name: str) -> nn.Module:
    from omegaconf import OmegaConf

    from runner.models import ZOO, build_model

    zoo, channels, size = MODELS[name]
    cfg = OmegaConf.create({"name": zoo, "_target_": ZOO[zoo], "in_channels": channels, "image_size": size,
                            "num_classes": 10})
    torch.manual_seed(0)
    return build_model(cfg, mean=[0.5] * channels if channels > 1 else 0.5,
                       std=[0.25] * channels if channels > 1 else 0.25).eval()


def median_us(timer, fn, args, repeat, warmup):
    for i in range(warmup):
        fn(args[i % len(args)])
    ts = [timer(lambda: fn(args[i % len(args)])) for i in range(repeat)]
    return statistics.median(ts), min(ts)


def kernel_call(layer, codes, algo):
    w, lut = layer.weight_codes, layer.lut
    if isinstance(layer, nn.Conv2d) or hasattr(layer, "stride"):
        return torch.ops.approx.lut_conv2d(codes, w, lut, list(layer.stride), list(layer.padding),
                                           list(layer.dilation), layer.groups, algo)
    return torch.ops.approx.lut_linear(codes, w, lut, algo)


def picked(layer, codes, backend):
    from runner.ops import algo_table

    conv = (layer.stride, layer.padding, layer.dilation, layer.groups) if hasattr(layer, "stride") else ()
    return next((r["auto_pick_name"] for r in algo_table(codes, layer.weight_codes, layer.lut, *conv,
                                                         backend=backend) if r["auto_pick"]), "")


def applicable(layer, codes, backend):
    from runner.ops import algo_table

    conv = (layer.stride, layer.padding, layer.dilation, layer.groups) if hasattr(layer, "stride") else ()
    return {r["algo"]: (r["applies"], r["note"]) for r in algo_table(codes, layer.weight_codes, layer.lut, *conv,
                                                                       backend=backend)}


@torch.no_grad()
def bench_model(name, args, dev, mult, qcfg, rows_l, rows_m):
    from runner.layers import convert_model, integer_links, quantized_layers
    from runner.models import fold_input_normalization
    from runner.quant import calibrate, quant_layers, quantize_act

    model = build(name)
    _, channels, size = MODELS[name]
    gen = torch.Generator().manual_seed(0)
    calib_x = torch.rand((256, channels, size, size), generator=gen)
    folded = fold_input_normalization(model, calib_x[:1])
    stats = calibrate(folded, calib_x, qcfg)
    approx = convert_model(folded, mult, qcfg, stats, backend=args.backend).to(dev).eval()
    folded, model = folded.to(dev).eval(), model.to(dev).eval()
    floats = quant_layers(folded)
    lut_layers = quantized_layers(approx)
    timer = device_timer(dev)
    from runner.ops import backend_algos

    algos = args.algos.split(",") if args.algos else [*backend_algos(args.backend), "auto"]
    shape = f"{channels}x{size}x{size}"
    links = integer_links(approx)  # requant=integer: the layers that hand codes, not fp32, to the next
    print(f"\n== {name} on {shape}: {len(lut_layers)} LUT layers ({len(links)} hand integer codes on), "
          f"multiplier {mult.name}", flush=True)
    print(f"{'layer':24} {'kind':9} {'k':3} {'s':1} {'cin':>4} {'cout':>4} {'grp':>4} {'batch':>6} "
          f"{'what':6} {'algo':22} {'us':>9} {'TMAC/s':>7}  note")
    for batch in args.layer_batches:
        # 3 input sets (repeats do not run from a warm L2) where they fit easily; large batches overflow L2 anyway
        xs = [torch.rand((batch, channels, size, size), generator=gen).to(dev) for _ in range(3 if batch <= 1000 else 1)]
        inputs = [layer_inputs(folded, x) for x in xs]
        for lname, layer in lut_layers.items():
            geo = layer_geometry(floats[lname])
            fl_inputs = [inp[lname] for inp in inputs]
            out_numel = floats[lname](fl_inputs[0]).numel()
            macs = out_numel * math.prod(layer.weight.shape[1:])
            codes = [quantize_act(x, layer.act_scale, layer.signed) for x in fl_inputs]
            if not hasattr(layer, "stride"):
                codes = [c.reshape(-1, c.shape[-1]) for c in codes]
            base = dict(model=name, input=shape, layer=lname, **geo, input_shape="x".join(map(str, fl_inputs[0].shape)),
                        batch=batch, macs=macs, multiplier=mult.name)
            table = applicable(layer, codes[0], args.backend)

            def emit(what, algo, us, lo, note=""):
                tmacs = macs / us / 1e6
                rows_l.append({**base, "what": what, "algo": algo, "median_us": us, "min_us": lo, "tmacs": tmacs,
                               "note": note})
                print(f"{lname:24} {geo['kind']:9} {geo['kernel']:3} {geo['stride']:1} {geo['in_channels']:4} "
                      f"{geo['out_channels']:4} {geo['groups']:4} {batch:6} {what:6} {algo:22} {us:9.1f} "
                      f"{tmacs:7.3f}  {note}", flush=True)

            for algo in algos:
                if algo != "auto" and not table.get(algo, (True, ""))[0]:
                    continue
                try:
                    kernel_call(layer, codes[0], algo)
                except RuntimeError as exc:  # a variant that does not run this shape
                    print(f"{lname:24} {algo}: {str(exc).splitlines()[0][:100]}")
                    continue
                us, lo = median_us(timer, lambda c: kernel_call(layer, c, algo), codes, args.repeat, args.warmup)
                emit("kernel", algo, us, lo, picked(layer, codes[0], args.backend) if algo == "auto" else "")
            us, lo = median_us(timer, layer, fl_inputs, args.repeat, args.warmup)
            emit("layer", "auto", us, lo)
            us, lo = median_us(timer, floats[lname], fl_inputs, args.repeat, args.warmup)
            emit("fp32", "cudnn" if dev.type == "cuda" else "torch", us, lo)
        del inputs, xs
    print(f"{'model':12} {'batch':>6} {'path':22} {'median ms':>10} {'x fp32':>7} {'x strict':>7}")
    for batch in args.model_batches:
        xs = [torch.rand((batch, channels, size, size), generator=gen).to(dev) for _ in range(3)]
        base = dict(model=name, input=shape, batch=batch, multiplier=mult.name, repeats=args.repeat)
        # fp32: PyTorch's defaults (cuDNN may run convs in TF32: torch.backends.cudnn.allow_tf32 is True by
        # default); fp32_strict: TF32 off, every product and sum in fp32
        tf32 = torch.backends.cudnn.allow_tf32
        runs = [("fp32", model, False, tf32), ("fp32_cudnn_benchmark", model, True, tf32),
                ("fp32_strict", model, False, False), ("approx", approx, False, tf32)]
        if dev.type == "cuda":  # each forward replayed from a CUDA graph, as compare's timed passes run it
            runs += [("fp32_graph", GraphedForward(model), False, tf32),
                     ("fp32_strict_graph", GraphedForward(model), False, False),
                     ("approx_graph", GraphedForward(approx), False, tf32)]
        times = {}
        for path, m, bench_on, allow_tf32 in runs:
            with torch.backends.cudnn.flags(enabled=True, benchmark=bench_on, deterministic=False,
                                            allow_tf32=allow_tf32):
                us, lo = median_us(timer, m, xs, args.repeat, args.warmup)
            times[path] = us
            rows_m.append({**base, "path": path, "median_ms": us / 1e3, "min_ms": lo / 1e3,
                           "images_per_s": batch / (us / 1e6), "cudnn_allow_tf32": allow_tf32})
        for r in rows_m[-len(runs):]:
            r["x_fp32"] = r["median_ms"] * 1e3 / times["fp32"]
            r["x_fp32_strict"] = r["median_ms"] * 1e3 / times["fp32_strict"]
            if "fp32_graph" in times:
                r["x_fp32_graph"] = r["median_ms"] * 1e3 / times["fp32_graph"]
                r["x_fp32_strict_graph"] = r["median_ms"] * 1e3 / times["fp32_strict_graph"]
            print(f"{name:12} {batch:6} {r['path']:22} {r['median_ms']:10.3f} {r['x_fp32']:7.2f} "
                  f"{r['x_fp32_strict']:7.2f}", flush=True)
        if args.profile and batch == max(args.model_batches) and dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(3):
                    approx(xs[i])
                torch.cuda.synchronize()
            print(f"-- {name} approx, batch {batch}: kernel time over 3 passes")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
        del xs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet20,vgg,mobilenetv2,lenet5,lenet5_classic,lenet5_rgb")
    ap.add_argument("--layer-batches", default="1000,10000")
    ap.add_argument("--model-batches", default="1,256,1000")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--multiplier", default="exact")
    ap.add_argument("--algos", default=None, help="default: every variant the kernels list, and auto")
    ap.add_argument("--profile", action="store_true", help="kernel breakdown of each approx model, largest batch")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "cpp"))
    ap.add_argument("--out", default="zoo_gpu", help="CSV prefix: PREFIX_layers.csv, PREFIX_models.csv")
    args = ap.parse_args()
    args.layer_batches = [int(b) for b in args.layer_batches.split(",") if b]
    args.model_batches = [int(b) for b in args.model_batches.split(",") if b]
    import runner._C  # noqa: F401
    from runner.multipliers.registry import get
    from runner.quant import QuantConfig

    dev = torch.device("cuda" if args.backend == "cuda" else "cpu")
    mult = get(args.multiplier)
    qcfg = QuantConfig()
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}, torch {torch.__version__}, cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
          f"repeat {args.repeat}, warmup {args.warmup}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    rows_l, rows_m = [], []
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        bench_model(name, args, dev, mult, qcfg, rows_l, rows_m)
        pd.DataFrame(rows_l).to_csv(f"{args.out}_layers.csv", index=False)
        pd.DataFrame(rows_m).to_csv(f"{args.out}_models.csv", index=False)
    layers = pd.DataFrame(rows_l)
    if not layers.empty:  # the summary the bars read: best variant and auto per layer, at the largest batch
        k = layers[(layers.what == "kernel")]
        variants = k[k.algo != "auto"]
        best = variants.loc[variants.groupby(["model", "layer", "batch"], sort=False).tmacs.idxmax()].sort_index()
        auto = k[k.algo == "auto"].set_index(["model", "layer", "batch"])
        print("\n== summary: best variant and auto per layer (kernel T MAC/s)")
        for _, r in best.sort_values(["model", "batch"], kind="stable").iterrows():
            a = auto.loc[(r.model, r.layer, r.batch)] if (r.model, r.layer, r.batch) in auto.index else None
            print(f"{r.model:14} {r.layer:24} {r.batch:6} best {r.algo:18} {r.tmacs:6.2f}  auto "
                  f"{'' if a is None else a.note:22} {float('nan') if a is None else a.tmacs:6.2f}")
    print(f"\nwrote {args.out}_layers.csv, {args.out}_models.csv")


if __name__ == "__main__":
    main()
