"""Every CUDA variant of approx::lut_conv2d / approx::lut_linear on every LeNet-5 layer and on
convolutions that expanded_window does not take, at several batch sizes: which variant wins where.

    python benchmarks/cuda_algos.py [--batches 1,256,10000] [--repeat 10] [--out FILE.json]
        [--algos A,B,...] [--shapes conv1,...]

Per (shape, batch, algo): median of `repeat` timings with CUDA events after warm-up, rotating
among 3 input sets, a sleep kernel queued before each (runner.bench.device_timer), prepared tables
cached as in a model's forward. Uniform unsigned codes, exact 8x8 LUT, random int8 weights.
A variant that does not run a shape is listed as such (its error's first line). Needs the CUDA
build of runner._C; no Hydra. The table of record is benchmarks/CUDA.md.
"""
import argparse
import json
import statistics

import torch

from runner.bench import LENET5_LAYERS, device_timer
from runner.multipliers.core import exact_lut

# name: (a shape per image, w shape, stride, padding, groups); stride None = linear layer
SHAPES = {
    **{name: (ashape, wshape, *((1, 0, 1) if kind == "conv" else (None, None, None)))
       for name, kind, ashape, wshape in LENET5_LAYERS},
    # shapes expanded_window rejects
    "conv_s2": ((16, 28, 28), (32, 16, 3, 3), 2, 1, 1),
    "conv_1x1": ((32, 14, 14), (64, 32, 1, 1), 1, 0, 1),
    "conv_7x7": ((3, 16, 16), (16, 3, 7, 7), 1, 3, 1),
    "conv_g4": ((16, 14, 14), (32, 4, 3, 3), 1, 1, 4),
    "conv_dw": ((32, 14, 14), (32, 1, 3, 3), 1, 1, 32),
    # <= 8 channels (where the retired expanded_resident applied) and <= 16 (expanded_smem)
    "conv_s2_n8": ((8, 28, 28), (8, 8, 3, 3), 2, 1, 1),
    "conv_1x1_n8": ((16, 14, 14), (8, 16, 1, 1), 1, 0, 1),
    "conv_7x7_n8": ((3, 16, 16), (8, 3, 7, 7), 1, 3, 1),
    "fc_n8": ((200,), (8, 200), None, None, None),
    "fc_n16": ((400,), (16, 400), None, None, None),
}


def call(name, a, w, lut, algo):
    _, _, stride, padding, groups = SHAPES[name]
    if stride is None:
        return torch.ops.approx.lut_linear(a, w, lut, algo)
    return torch.ops.approx.lut_conv2d(a, w, lut, [stride] * 2, [padding] * 2, [1, 1], groups, algo)


def macs(out, w):
    per_out = w[0].numel()  # taps of one output channel
    return out.numel() * per_out


def picked(name, a, w, lut):
    """auto's pick for this call, as the kernels report it (approx::lut_algos)."""
    from runner.ops import algo_table

    _, _, stride, padding, groups = SHAPES[name]
    conv = () if stride is None else (stride, padding, 1, groups)
    return next((r["auto_pick_name"] for r in algo_table(a, w, lut, *conv, backend="cuda") if r["auto_pick"]), "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,256,10000")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--algos", default=None, help="default: every variant the kernels list, and auto")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import runner._C  # noqa: F401
    from runner.ops import backend_algos

    args.algos = args.algos or ",".join((*backend_algos("cuda"), "auto"))

    gen = torch.Generator(device="cuda").manual_seed(0)
    lut = exact_lut(signed=False).to("cuda")
    timer = device_timer(torch.device("cuda"))
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':9} {'batch':>6} {'algo':17} {'median us':>10} {'G MAC/s':>9}  note")
    for name in args.shapes.split(","):
        ashape, wshape = SHAPES[name][:2]
        for batch in (int(b) for b in args.batches.split(",")):
            w = torch.randint(-127, 128, wshape, generator=gen, dtype=torch.int8, device="cuda")
            inputs = [torch.randint(0, 256, (batch, *ashape), generator=gen, dtype=torch.uint8,
                                    device="cuda") for _ in range(3)]
            for algo in args.algos.split(","):
                wa = w.clone()  # own weights: tables are cached per weights tensor
                row = dict(shape=name, batch=batch, algo=algo)
                try:
                    out = call(name, inputs[0], wa, lut, algo)
                except RuntimeError as exc:  # a variant that does not run this shape
                    rows.append({**row, "supported": False, "note": str(exc).splitlines()[0]})
                    print(f"{name:9} {batch:6} {algo:17} {'-':>10} {'-':>9}  {rows[-1]['note'][:60]}")
                    continue
                for i in range(args.warmup):
                    call(name, inputs[i % 3], wa, lut, algo)
                ts = [timer(lambda: call(name, inputs[i % 3], wa, lut, algo))
                      for i in range(args.repeat)]
                med = statistics.median(ts)
                n = macs(out, w)
                note = picked(name, inputs[0], wa, lut) if algo == "auto" else ""
                rows.append({**row, "supported": True, "median_us": med, "min_us": min(ts),
                             "gmacs": n / med / 1e3, "macs": n, "note": note})
                print(f"{name:9} {batch:6} {algo:17} {med:10.1f} {n / med / 1e3:9.1f}  {note}",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           repeat=args.repeat, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
