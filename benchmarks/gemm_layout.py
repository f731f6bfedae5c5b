"""auto's GEMM layout for convs of one group (extensions/csrc/cuda/lut_ops.cpp, `gemm_layout`): the conv run as
expanded_gemm's stride-1 1x1 conv over its taps, whose codes that kernel copies with cp.async. A strided 1x1 conv
gets its sampled codes, a strided 3x3 conv its taps (im2col, cuda/layouts.cu), planes that are not a multiple of 4
pixels (7x7) the batch folded into one image; a 3x3 conv of stride 1 on other planes either way, auto timing the
taps against the shape as given on its first call. Per ResNet
shape and batch: `auto` (which takes the layout, the copy included) against every variant named on the shapes as
given (a named variant runs them as given), so `auto / best` below 1 is what the layout gains over any pick auto
could make without it.

    python benchmarks/gemm_layout.py [--shapes 1x1,3x3] [--batches 1,8,16,32,64,256] [--repeat 20]
    python benchmarks/gemm_layout.py --model resnet50 --batches 64 [--repeat 10]

--model: instead of uniform random codes, the codes each conv of that converted torchvision model (random weights,
the exact table, N(0, 1) images) really gets, recorded at its op in one forward, one conv of each distinct shape
(convs of one group: a model's depthwise convs are left out).
Some variants are much faster on a network's codes than on uniform ones (`expanded_window`: up to 1.3x on
ResNet-18's), which decides where the layout pays.

Each call replayed from a CUDA graph captured after warm-up calls (auto's trials, the table builds), as `compare`
times a model: eager, small batches time the host's dispatch, which the layouts' extra ops lengthen. Medians of
`repeat` CUDA-event timings (runner.evaluate.device_timer), the replays alternated; auto's result checked equal to
`direct`'s (uniform codes), every variant's to auto's. Results: benchmarks/imagenet.md, "Pointwise convs in the
copied-codes layout", "3x3 convs as a GEMM over their taps" and "Stride-1 3x3 convs: the taps timed against the
shape as given"."""
import argparse
import statistics

import torch

import runner._C  # noqa: F401
from runner.evaluate import device_timer
from runner.multipliers.core import exact_lut
from runner.ops import algo_table

# (C, H, N, kernel, stride), padding kernel // 2. 1x1: ResNet-50's strided ones (the downsamples) and those on 7x7
# planes. 3x3: ResNet-50's (C -> C) and ResNet-18's strided ones (C -> 2 C).
SHAPES = {
    "1x1": [(256, 56, 512, 1, 2), (512, 28, 1024, 1, 2), (1024, 14, 2048, 1, 2), (512, 7, 2048, 1, 1),
            (2048, 7, 512, 1, 1)],
    "3x3": [(64, 56, 64, 3, 1), (128, 56, 128, 3, 2), (128, 28, 128, 3, 1), (256, 28, 256, 3, 2),
            (256, 14, 256, 3, 1), (512, 14, 512, 3, 2), (512, 7, 512, 3, 1), (64, 56, 128, 3, 2),
            (128, 28, 256, 3, 2), (256, 14, 512, 3, 2)],
}
NAMED = ("expanded_gemm_r8c", "expanded_gemm_r8c_k2", "expanded_gemm_r8c_k3", "expanded_gemm_r8c_k4",
         "expanded_gemm_r8c_k5", "expanded_gemm_r8c_k8", "expanded_gemm_r8c_k16", "expanded_gemm_r8c_k33",
         "expanded_gemm_r16c", "expanded_gemm_r16c_k2", "expanded_gemm_r13c", "expanded_gemm_r13c_k2",
         "expanded_window", "expanded_window_c13",
         "expanded_window_x7_c18", "expanded_window_x7_c21")


def network_calls(name: str, batch: int, ops_, backend: str = "cuda"):
    """(op, args, kwargs) of the first call of each of runner.ops_autograd's ops named in ops_ on each distinct
    shape (codes, weights, geometry), as the converted model (random weights, the exact table) makes them in a
    forward of N(0, 1) images, after one forward for auto's trials and the tables."""
    import torchvision

    import runner.ops_autograd as oa
    from runner.layers import approximate

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    _, approx = approximate(model, "exact", torch.randn(16, 3, 224, 224), backend=backend)
    device = "cuda" if backend == "cuda" else "cpu"
    approx, x = approx.to(device), torch.randn(batch, 3, 224, 224, device=device)
    real, seen = {op: getattr(oa, op) for op in ops_}, {}

    def recorder(op):
        def call(*args, **kw):
            seen.setdefault((op, tuple(args[0].shape), tuple(args[1].shape), str(args[3:7])), (op, args, kw))
            return real[op](*args, **kw)
        return call
    with torch.no_grad():
        approx(x)  # auto's trials and the tables first
        try:
            for op in ops_:
                setattr(oa, op, recorder(op))
            approx(x)
        finally:
            for op in ops_:
                setattr(oa, op, real[op])
    return list(seen.values())


def network_convs(name: str, batch: int, backend: str = "cuda"):
    """One (codes, weights, LUT, stride, padding, dilation, groups) of each distinct conv shape of the converted
    model, as its conv op gets them in a forward of N(0, 1) images (runner.ops_autograd's conv ops, recorded)."""
    seen = {}
    for _, args, _ in network_calls(name, batch, ("lut_conv2d_dequantize", "lut_conv2d_requantize_codes",
                                                  "lut_conv2d"), backend):
        a, w, lut, *geometry = args[:7]
        seen.setdefault((tuple(a.shape), tuple(w.shape), str(geometry)), (a, w, lut, *geometry))
    return list(seen.values())


def pair(v):
    return [v, v] if isinstance(v, int) else list(v)


def timed(conv, repeat, timer):
    """{algo: median us} of auto and each variant named that runs the call, each replayed from a CUDA graph, the
    replays alternated; every result checked equal to auto's."""
    want = conv("auto")
    graphs = {}
    for algo in ("auto", *NAMED):
        try:
            ok = torch.equal(conv(algo), want)
        except RuntimeError:  # a variant that does not run the shape
            continue
        assert ok, f"{algo} differs from auto"
        conv(algo)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            conv(algo)
        graphs[algo] = graph
    ts = {algo: [] for algo in graphs}
    for _ in range(repeat):
        for algo, graph in graphs.items():
            ts[algo].append(timer(graph.replay))
    return {algo: statistics.median(t) for algo, t in ts.items()}


def report(label, med, pick):
    ran = [k for k in NAMED if k in med]
    if not ran:  # no named GEMM variant runs the shape
        print(f"{label} {med['auto']:9.1f} {'-':>14} {'-':>11}  -, {pick}", flush=True)
        return
    best = min(ran, key=med.get)
    print(f"{label} {med['auto']:9.1f} {med[best]:14.1f} {med['auto'] / med[best]:11.3f}  {best}, {pick}", flush=True)


def auto_pick(a, w, lut, *geometry):
    return next((r["auto_pick_name"] for r in algo_table(a, w, lut, *geometry[:4], backend="cuda") if r["auto_pick"]),
                "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="the codes of this torchvision model's convs, not uniform ones")
    ap.add_argument("--shapes", default="1x1,3x3")
    ap.add_argument("--batches", default="1,8,16,32,64,256")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    timer = device_timer(torch.device("cuda"))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':26} {'batch':>5} {'auto us':>9} {'best named us':>14} {'auto / best':>11}  "
          "best named, auto's pick")
    if args.model:
        for batch in (int(b) for b in args.batches.split(",")):
            for a, w, lut, stride, padding, dilation, groups in network_convs(args.model, batch):
                if groups != 1:  # depthwise and grouped convs: not the layout's (convs of one group)
                    continue
                conv = lambda algo: torch.ops.approx.lut_conv2d(  # noqa: E731
                    a, w, lut, pair(stride), pair(padding), pair(dilation), groups, algo)
                label = f"{w.shape[2]}x{w.shape[3]} {a.shape[1]}x{a.shape[2]}->{w.shape[0]} s{pair(stride)[0]}"
                report(label.ljust(26) + f" {batch:5}", timed(conv, args.repeat, timer),
                       auto_pick(a, w, lut, stride, padding, dilation, groups))
        return
    lut = exact_lut(signed=False).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for c, hw, n, k, s in (shape for group in args.shapes.split(",") for shape in SHAPES[group]):
        w = torch.randint(-127, 128, (n, c, k, k), generator=gen, dtype=torch.int8, device="cuda")
        conv_args = ([s, s], [k // 2, k // 2], [1, 1], 1)
        for batch in (int(b) for b in args.batches.split(",")):
            a = torch.randint(0, 256, (batch, c, hw, hw), generator=gen, dtype=torch.uint8, device="cuda")
            conv = lambda algo: torch.ops.approx.lut_conv2d(a, w, lut, *conv_args, algo)  # noqa: E731
            assert torch.equal(conv("auto"), conv("direct")), f"auto differs from direct at {(c, hw, n, k, s)}"
            report(f"{k}x{k} {c}x{hw}->{n} s{s}".ljust(26) + f" {batch:5}", timed(conv, args.repeat, timer),
                   auto_pick(a, w, lut, *conv_args))


if __name__ == "__main__":
    main()
