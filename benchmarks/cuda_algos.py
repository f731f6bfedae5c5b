"""Every CUDA variant of approx::lut_conv2d / approx::lut_linear on every LeNet-5 layer and on
convolutions that expanded_window does not take, at several batch sizes: which variant wins where.

    python benchmarks/cuda_algos.py [--batches 1,256,10000] [--repeat 10] [--out FILE.json]
        [--algos A,B,...] [--shapes conv1,...] [--check]

--shapes takes shape names and groups of them: `lenet` (the default: LeNet-5 and the small extra
convolutions), `r50` (ResNet-50's distinct 1x1 convs, per image), `r50k` (its 7x7 stem and distinct
3x3 convs), `vit` (ViT-B/16's Linear layers, 197 tokens an image),
`mbv2dw` (MobileNetV2's distinct depthwise 3x3 convs). --check compares every variant's
whole output with `direct`'s (exact), and `direct`'s first image (linear: first 16 rows) with the
python reference.

Per (shape, batch, algo): median of `repeat` timings with CUDA events after warm-up, rotating
among 3 input sets, a sleep kernel queued before each (runner.bench.device_timer), prepared tables
cached as in a model's forward. --graph-calls N times one replay of a CUDA graph of N calls instead,
over N: a call's share of a graphed forward, without what events around a lone call add (2.2-2.5 us at
batch 64 on an H200). Uniform unsigned codes, exact 8x8 LUT, random int8 weights.
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
GROUPS = {"lenet": list(SHAPES)}
# ResNet-50 (torchvision): every distinct 1x1 conv, input per image (C, H, W); stride 2: the downsamples
R50_1X1 = [(64, 56, 64, 1), (64, 56, 256, 1), (256, 56, 64, 1), (256, 56, 128, 1), (256, 56, 512, 2),
           (128, 28, 512, 1), (512, 28, 128, 1), (512, 28, 256, 1), (512, 28, 1024, 2),
           (256, 14, 1024, 1), (1024, 14, 256, 1), (1024, 14, 512, 1), (1024, 14, 2048, 2),
           (512, 7, 2048, 1), (2048, 7, 512, 1)]
for c, hw, n, st in R50_1X1:
    SHAPES[f"r50_{c}x{hw}_{n}" + ("_s2" if st == 2 else "")] = ((c, hw, hw), (n, c, 1, 1), st, 0, 1)
GROUPS["r50"] = [k for k in SHAPES if k.startswith("r50_")]
# ResNet-50: its 7x7 stem and every distinct 3x3 conv (stride 2 in the first block of layers 2-4),
# input per image (C, H, W)
SHAPES["r50k_stem"] = ((3, 224, 224), (64, 3, 7, 7), 2, 3, 1)
for c, hw, st in ((64, 56, 1), (128, 56, 2), (128, 28, 1), (256, 28, 2), (256, 14, 1), (512, 14, 2), (512, 7, 1)):
    SHAPES[f"r50k_{c}x{hw}" + ("_s2" if st == 2 else "")] = ((c, hw, hw), (c, c, 3, 3), st, 1, 1)
GROUPS["r50k"] = [k for k in SHAPES if k.startswith("r50k_")]
# MobileNetV2 (torchvision): every distinct depthwise 3x3 conv, input per image (C, H, W), padding 1
for c, hw, st in ((32, 112, 1), (96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1), (192, 28, 2), (384, 14, 1),
                  (576, 14, 1), (576, 14, 2), (960, 7, 1)):
    SHAPES[f"mbv2dw_{c}x{hw}" + ("_s2" if st == 2 else "")] = ((c, hw, hw), (c, 1, 3, 3), st, 1, c)
GROUPS["mbv2dw"] = [k for k in SHAPES if k.startswith("mbv2dw_")]
# ViT-B/16: 197 tokens an image (rows = batch x 197), K -> N
for name, k, n in (("qkv", 768, 2304), ("proj", 768, 768), ("fc1", 768, 3072), ("fc2", 3072, 768)):
    SHAPES[f"vit_{name}"] = ((197, k), (n, k), None, None, None)
GROUPS["vit"] = [k for k in SHAPES if k.startswith("vit_")]


def call(name, a, w, lut, algo):
    _, _, stride, padding, groups = SHAPES[name]
    if stride is None:
        return torch.ops.approx.lut_linear(a, w, lut, algo)
    return torch.ops.approx.lut_conv2d(a, w, lut, [stride] * 2, [padding] * 2, [1, 1], groups, algo)


def reference(name, a, w, lut):
    from runner.reference import reference_lut_conv2d, reference_lut_linear

    _, _, stride, padding, groups = SHAPES[name]
    if stride is None:
        return reference_lut_linear(a, w, lut)
    return reference_lut_conv2d(a, w, lut, stride, padding, 1, groups)


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
    ap.add_argument("--shapes", default="lenet", help="names, or groups: lenet, r50, r50k, vit, mbv2dw")
    ap.add_argument("--check", action="store_true", help="every variant against direct, direct against the reference")
    ap.add_argument("--graph-calls", type=int, default=0, metavar="N",
                    help="time a CUDA graph of N back-to-back calls, per call, as a graphed forward runs a layer "
                         "(benchmarks/imagenet.md, 'Depthwise convs timed as a graph runs them')")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.graph_calls < 0:
        ap.error(f"--graph-calls {args.graph_calls}: give a number of calls >= 1, or 0 to time single calls")
    import runner._C  # noqa: F401
    from runner.ops import backend_algos

    args.algos = args.algos or ",".join((*backend_algos("cuda"), "auto"))

    gen = torch.Generator(device="cuda").manual_seed(0)
    lut = exact_lut(signed=False).to("cuda")
    timer = device_timer(torch.device("cuda"))
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':9} {'batch':>6} {'algo':17} {'median us':>10} {'G MAC/s':>9}  note")
    names = [n for g in args.shapes.split(",") for n in GROUPS.get(g, [g])]
    bad_checks = 0
    for name in names:
        ashape, wshape = SHAPES[name][:2]
        for batch in (int(b) for b in args.batches.split(",")):
            w = torch.randint(-127, 128, wshape, generator=gen, dtype=torch.int8, device="cuda")
            inputs = [torch.randint(0, 256, (batch, *ashape), generator=gen, dtype=torch.uint8,
                                    device="cuda") for _ in range(3)]
            if SHAPES[name][2] is None:  # linear: tokens x features per image -> rows
                inputs = [x.reshape(-1, ashape[-1]) for x in inputs]
            base = None
            if args.check:
                base = call(name, inputs[0], w.clone(), lut, "direct")
                head = inputs[0][:16] if SHAPES[name][2] is None else inputs[0][:1]
                want = reference(name, head.cpu(), w.cpu(), lut.cpu())
                ok = torch.equal(base[:head.shape[0]].cpu(), want)
                bad_checks += not ok
                print(f"{name:9} {batch:6} check direct vs reference ({head.shape[0]} rows/images): "
                      f"{'equal' if ok else 'DIFFERENT'}", flush=True)
            for algo in args.algos.split(","):
                wa = w.clone()  # own weights: tables are cached per weights tensor
                row = dict(shape=name, batch=batch, algo=algo)
                try:
                    out = call(name, inputs[0], wa, lut, algo)
                except RuntimeError as exc:  # a variant that does not run this shape
                    rows.append({**row, "supported": False, "note": str(exc).splitlines()[0]})
                    print(f"{name:9} {batch:6} {algo:17} {'-':>10} {'-':>9}  {rows[-1]['note'][:60]}")
                    continue
                if base is not None:
                    ok = torch.equal(out, base)
                    bad_checks += not ok
                    print(f"{name:9} {batch:6} check {algo} vs direct: {'equal' if ok else 'DIFFERENT'}", flush=True)
                for i in range(args.warmup):
                    call(name, inputs[i % 3], wa, lut, algo)
                if args.graph_calls:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for i in range(args.graph_calls):
                            call(name, inputs[i % 3], wa, lut, algo)
                    graph.replay()
                    ts = [timer(graph.replay) / args.graph_calls for _ in range(args.repeat)]
                    del graph
                else:
                    ts = [timer(lambda: call(name, inputs[i % 3], wa, lut, algo))
                          for i in range(args.repeat)]
                med = statistics.median(ts)
                n = macs(out, w)
                note = picked(name, inputs[0], wa, lut) if algo == "auto" else ""
                rows.append({**row, "supported": True, "median_us": med, "min_us": min(ts),
                             "gmacs": n / med / 1e3, "macs": n, "note": note})
                print(f"{name:9} {batch:6} {algo:17} {med:10.1f} {n / med / 1e3:9.1f}  {note}",
                      flush=True)
    if args.check:
        print(f"checks: {'all equal' if bad_checks == 0 else f'{bad_checks} DIFFERENT'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           repeat=args.repeat, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
