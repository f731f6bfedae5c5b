"""The copy into auto's GEMM layout (extensions/csrc/cuda/layouts.cu) on ResNet-50's 3x3 convs: the copy kernel's
time per call (torch.profiler's CUDA kernel times, 5 calls after 2 warm-up calls of `auto`, uniform codes) and the
bytes it writes over that time. The convs in the taps' layout run this copy, then expanded_gemm's 1x1 conv over it.

    python benchmarks/layout_copy.py [--batches 64,256]

Results: benchmarks/imagenet.md, "Tall tiles of equal rows"."""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import runner._C  # noqa: F401
from runner.multipliers.core import exact_lut

# (C, H, stride) of ResNet-50's 3x3 convs C -> C whose taps auto copies (those on 7x7 outputs are folded instead)
CONVS = [(64, 56, 1), (128, 56, 2), (128, 28, 1), (256, 28, 2), (256, 14, 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    args = ap.parse_args()
    lut = exact_lut(signed=False).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for batch in (int(b) for b in args.batches.split(",")):
        for c, hw, s in CONVS:
            a = torch.randint(0, 256, (batch, c, hw, hw), generator=gen, dtype=torch.uint8, device="cuda")
            w = torch.randint(-127, 128, (c, c, 3, 3), generator=gen, dtype=torch.int8, device="cuda")

            def conv():
                return torch.ops.approx.lut_conv2d(a, w, lut, [s, s], [1, 1], [1, 1], 1, "auto")
            conv(), conv()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    conv()
                torch.cuda.synchronize()
            written = batch * c * 9 * (hw // s) ** 2
            for e in prof.key_averages():
                if "layout" in e.key:
                    us = e.device_time_total / e.count
                    print(f"batch {batch:3} 3x3 {c}x{hw} s{s}: {us:7.1f} us, {written / 1e6:4.0f} MB written, "
                          f"{written / us / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
