"""auto's layouts for 1x1 convs without padding (extensions/csrc/cuda/lut_ops.cpp, `pointwise_layout`): a strided
conv run as the stride-1 conv of its sampled codes, planes that are not a multiple of 4 pixels (7x7) with the
batch folded into one image, both so that expanded_gemm copies the codes with cp.async. Per ResNet-50 shape and
batch: `auto` (which takes the layout) against every variant named on the shapes as given (a named variant runs
them as given), so `auto / best` below 1 is what the layout gains over any pick auto could make without it.

    python benchmarks/pointwise_layout.py [--batches 1,8,16,32,64,256] [--repeat 20]

Each call replayed from a CUDA graph captured after warm-up calls (auto's trials, the table builds), as `compare`
times a model: eager, small batches time the host's dispatch, which the layouts' extra ops lengthen. Medians of
`repeat` CUDA-event timings (runner.evaluate.device_timer), the replays alternated; every result checked equal to
`direct`'s. Results: benchmarks/imagenet.md,
"Pointwise convs in the copied-codes layout"."""
import argparse
import statistics

import torch

import runner._C  # noqa: F401
from runner.evaluate import device_timer
from runner.multipliers.core import exact_lut
from runner.ops import algo_table

# ResNet-50's strided 1x1 convs (the downsamples) and its 1x1 convs on 7x7 planes: (C, H, N, stride)
SHAPES = [(256, 56, 512, 2), (512, 28, 1024, 2), (1024, 14, 2048, 2), (512, 7, 2048, 1), (2048, 7, 512, 1)]
NAMED = ("expanded_gemm_r8c", "expanded_gemm_r8c_k2", "expanded_gemm_r8c_k3", "expanded_gemm_r8c_k4",
         "expanded_gemm_r8c_k5", "expanded_gemm_r8c_k8", "expanded_gemm_r8c_k16", "expanded_gemm_r8c_k33",
         "expanded_gemm_r16c", "expanded_gemm_r16c_k2", "expanded_window")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,16,32,64,256")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    lut = exact_lut(signed=False).cuda()
    timer = device_timer(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'shape':22} {'batch':>5} {'auto us':>9} {'best named us':>14} {'auto / best':>11}  best named, auto's pick")
    for c, hw, n, s in SHAPES:
        w = torch.randint(-127, 128, (n, c, 1, 1), generator=gen, dtype=torch.int8, device="cuda")
        for batch in (int(b) for b in args.batches.split(",")):
            a = torch.randint(0, 256, (batch, c, hw, hw), generator=gen, dtype=torch.uint8, device="cuda")
            conv = lambda algo: torch.ops.approx.lut_conv2d(a, w, lut, [s, s], [0, 0], [1, 1], 1, algo)  # noqa: E731
            want = conv("direct")
            algos = []
            for algo in ("auto", *NAMED):
                try:
                    ok = torch.equal(conv(algo), want)
                except RuntimeError:  # a variant that does not run the shape
                    continue
                assert ok, f"{algo} differs from direct at {(c, hw, n, s)}, batch {batch}"
                for _ in range(2):
                    conv(algo)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    conv(algo)
                algos.append((algo, graph))
            ts = {algo: [] for algo, _ in algos}
            for _ in range(args.repeat):
                for algo, graph in algos:
                    ts[algo].append(timer(graph.replay))
            med = {algo: statistics.median(t) for algo, t in ts.items()}
            best = min(NAMED, key=lambda k: med.get(k, float("inf")))
            pick = next((r["auto_pick_name"] for r in algo_table(a, w, lut, s, backend="cuda") if r["auto_pick"]), "")
            print(f"{c}x{hw}->{n} s{s}".ljust(22) + f" {batch:5} {med['auto']:9.1f} {med[best]:14.1f} "
                  f"{med['auto'] / med[best]:11.3f}  {best}, {pick}", flush=True)


if __name__ == "__main__":
    main()
