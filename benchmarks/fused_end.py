"""A conv and its end in one op (approx::lut_conv2d_dequantize / lut_conv2d_requantize_codes) against the two ops
it replaces (lut_conv2d, then dequantize / requantize_codes), on the GPU, per conv shape and end:

    python benchmarks/fused_end.py [--shapes r50,r50k] [--batch 64] [--repeat 20] [--graph]
    python benchmarks/fused_end.py --model mobilenet_v2 [--depthwise] [--batch 64] [--graph]

Ends: `handoff` (requantize_codes: the next layer's codes alone), `block` (dequantize with a residual, the ReLU
and the next layer's codes: a residual block's last conv), `plain` (dequantize alone: a downsample's output).
`auto` in both, after warm-up calls (auto's trials, the table builds), so the fused op runs auto's cached pick:
where that variant applies the end in its stores (expanded_window, an unsplit expanded_gemm, depthwise_rows,
depthwise_planes) the sums are never written, else the op runs the same two ops. Medians of `repeat` CUDA-event timings
(runner.bench.device_timer), fused and two-op calls alternated, the range of the alternated pairs' ratios, the one
op's T MAC/s, and whether its output equals the two ops' (`same`). Shapes: benchmarks/cuda_algos.py's
groups. Results: benchmarks/imagenet.md, "A conv's end in expanded_gemm's stores".
"""
import argparse
import statistics

import torch

from runner import ops
from runner.bench import device_timer
from runner.multipliers.core import exact_lut
from runner.quant import requant_multiplier

from cuda_algos import GROUPS, SHAPES


def ends(n, out_shape, dev):
    g = torch.Generator().manual_seed(0)
    sa, sw, bias = torch.tensor(0.01), torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)
    m0, shift = requant_multiplier(torch.rand(n, dtype=torch.float64, generator=g) * 1e-3 + 1e-5)
    qb = torch.randint(-500, 500, (n,), generator=g, dtype=torch.int32)
    residual = torch.randn(out_shape, generator=g)
    codes = torch.empty(out_shape, dtype=torch.uint8)
    sa, sw, bias, m0, shift, qb, residual, codes = (t.to(dev) for t in (sa, sw, bias, m0, shift, qb, residual, codes))
    cs = torch.tensor(0.05, device=dev)
    return {
        "handoff": (lambda acc: ops.requantize_codes(acc, qb, m0, shift, 0, 255, False, backend="cuda"),
                    lambda conv: ops.lut_conv2d_requantize_codes(*conv, qb, m0, shift, 0, 255, False, backend="cuda")),
        "block": (lambda acc: ops.dequantize(acc, sa, sw, bias, residual, True, codes, cs, backend="cuda"),
                  lambda conv: ops.lut_conv2d_dequantize(*conv, sa, sw, bias, residual, True, codes, cs,
                                                         backend="cuda")),
        "plain": (lambda acc: ops.dequantize(acc, sa, sw, bias, backend="cuda"),
                  lambda conv: ops.lut_conv2d_dequantize(*conv, sa, sw, bias, backend="cuda")),
    }


def shape_cases(args, lut, dev):
    """(label, conv, {end: (two ops, one op)}) of each conv shape, uniform codes, the ends of `ends`."""
    for name in (s for grp in args.shapes.split(",") for s in GROUPS.get(grp, [grp])):
        ashape, wshape, stride, pad, groups = SHAPES[name]
        if stride is None:
            continue  # linear layers: no fused op
        g = torch.Generator().manual_seed(1)
        a = torch.randint(0, 256, (args.batch, *ashape), generator=g, dtype=torch.uint8).to(dev)
        w = torch.randint(-127, 128, wshape, generator=g, dtype=torch.int8).to(dev)
        conv = (a, w, lut, stride, pad, 1, groups)
        out_shape = ops.lut_conv2d(*conv, backend="cuda").shape
        shape_ends = ends(wshape[0], out_shape, dev)
        yield name, conv, {end: shape_ends[end] for end in args.ends.split(",")}


def model_cases(args):
    """The same for each distinct conv of a converted torchvision model that runs a fused op in its forward, with
    the codes, the end's arguments and the variant the model gives it (gemm_layout.network_calls)."""
    from gemm_layout import network_calls

    fused = {"lut_conv2d_requantize_codes": ("handoff", ops.requantize_codes),
             "lut_conv2d_dequantize": ("dequant", ops.dequantize)}
    for op, a, kw in network_calls(args.model, args.batch, tuple(fused)):
        conv, rest, algo = a[:7], a[7:], kw.get("algo", "auto")
        if args.depthwise and not (conv[6] == conv[0].shape[1] == conv[1].shape[0] > 1):
            continue
        end, end_op = fused[op]
        two = (lambda acc, rest=rest, end_op=end_op: end_op(acc, *rest, backend="cuda"))
        one = (lambda c, rest=rest, op=op, algo=algo: getattr(ops, op)(*c, *rest, backend="cuda", algo=algo))
        c, hw, n, k = conv[0].shape[1], conv[0].shape[2], conv[1].shape[0], conv[1].shape[2]
        s = conv[3] if isinstance(conv[3], int) else conv[3][0]
        yield f"{k}x{k} {c}x{hw}->{n}" + (f" s{s}" if s != 1 else ""), conv, {end: (two, one)}


def timed_paths(paths, repeat, timer, graph):
    """{name: [us]} of each path, alternated; replayed from a CUDA graph where graph."""
    for fn in paths.values():
        fn(), fn()
    if graph:
        graphs = {}
        for k, fn in paths.items():
            graphs[k] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[k]):
                fn()
        paths = {k: g.replay for k, g in graphs.items()}
    ms = {k: [] for k in paths}
    for _ in range(repeat):
        for k, fn in paths.items():
            ms[k].append(timer(fn))
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="r50,r50k")
    ap.add_argument("--model", default="", help="a torchvision model's convs on their own codes, not the shapes")
    ap.add_argument("--depthwise", action="store_true", help="with --model: its depthwise convs alone")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--ends", default="handoff,block,plain")
    ap.add_argument("--graph", action="store_true", help="each path replayed from a CUDA graph")
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = device_timer(dev)
    lut = exact_lut(signed=False).to(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, batch {args.batch}, exact table, "
          f"medians of {args.repeat}" + (", graphed" if args.graph else "") + (f", {args.model}'s codes" if args.model
                                                                                 else ", uniform codes"))
    print(f"{'shape':22} {'end':8} {'auto pick':26} {'two ops us':>11} {'one op us':>10} {'speed-up':>8} "
          f"{'(min-max of the pairs)':>22} {'T MAC/s':>8} same")
    for name, conv, conv_ends in (model_cases(args) if args.model else shape_cases(args, lut, dev)):
        pick = next((r["auto_pick_name"] for r in ops.algo_table(*conv, backend="cuda") if r["auto_pick"]), "?")
        macs = ops.lut_conv2d(*conv, backend="cuda").numel() * conv[1][0].numel()
        for end, (two, one) in conv_ends.items():
            paths = {"two": lambda: two(ops.lut_conv2d(*conv, backend="cuda")), "one": lambda: one(conv)}
            same = torch.equal(paths["one"](), paths["two"]())
            ms = timed_paths(paths, args.repeat, timer, args.graph)
            t2, t1 = statistics.median(ms["two"]), statistics.median(ms["one"])
            pairs = [b / a for a, b in zip(ms["one"], ms["two"])]
            print(f"{name:22} {end:8} {pick:26} {t2:11.1f} {t1:10.1f} {t2 / t1:8.3f} "
                  f"{min(pairs):11.3f}-{max(pairs):.3f} {macs / t1 / 1e6:8.2f} {same}", flush=True)


if __name__ == "__main__":
    main()
