"""Where a converted torchvision model's GPU time goes: its CUDA kernels, eager and replayed from a CUDA graph.

    python3 benchmarks/imagenet_profile.py MODEL BATCH      # e.g. vit_b_16 64, resnet18 256, mobilenet_v2 256

Random weights, the exact table in every Conv2d/Linear (runner.layers.approximate, backend=cuda), 3x224x224 N(0, 1)
inputs, TF32 matmuls off. After two warm-up forwards of each path (auto's trials, table builds, the capture),
torch.profiler records three forwards of each and prints, per path, the kernel time and count a forward and the
25 kernels that take most of it. Table builds (build_table_kernel, prep_kernel) or host read-backs (Memcpy DtoH)
in every forward mean the prepared-table cache misses; different kernels in the two paths mean the capture picked
differently (extensions/csrc/README.md)."""
import collections
import sys

import torch
import torchvision

from runner.graphs import GraphedForward
from runner.layers import approximate


def main(name: str, batch: int) -> None:
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval()
    _, approx = approximate(model, "exact", torch.randn(16, 3, 224, 224), backend="cuda")
    approx = approx.cuda()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    graphed = GraphedForward(approx)
    with torch.no_grad():
        for _ in range(2):
            approx(x), graphed(x)
        torch.cuda.synchronize()
        for label, fn in (("eager", lambda: approx(x)), ("graph", lambda: graphed(x))):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            agg = collections.defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    a = agg[e.name[:90]]
                    a[0] += 1
                    a[1] += e.device_time_total
            total = sum(v[1] for v in agg.values())
            print(f"== {label}: {total / 3 / 1e3:.2f} ms of kernels a forward, "
                  f"{sum(v[0] for v in agg.values()) // 3} kernels")
            for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:25]:
                print(f"{t / 3 / 1e3:9.3f} ms {n // 3:5d}x  {k}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vit_b_16", int(sys.argv[2]) if len(sys.argv) > 2 else 64)
