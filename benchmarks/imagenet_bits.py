"""Do backend=cuda and backend=cpp give the same logits, bit for bit, on torchvision ImageNet models at 3x224x224?

    python benchmarks/imagenet_bits.py --models resnet50,mobilenet_v2 --images 32 --multipliers exact,mul8s_1L2J

Random weights (seeded; the kernels' arithmetic does not depend on trained values), one table in every
Conv2d/Linear, scales calibrated once on 16 N(0, 1) images: the cpp model runs on the CPU, a copy of it converted
for backend=cuda (the same scales: the script checks their state dicts are equal) on the GPU, each on the same
N(0, 1) images in batches of --batch. Prints, per model and table, the images whose logits differ (0 is the
bar), the largest |difference| and the auto picks of the cuda model's layers. Exit 1 if any logits differ.
Without a GPU the second side is a second cpp model on the CPU (a dry run that checks the script)."""
from __future__ import annotations

import argparse
import collections
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,mobilenet_v2")
    ap.add_argument("--multipliers", default="exact,mul8s_1L2J")
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torchvision

    from runner.layers import approximate, auto_picks

    cuda = torch.cuda.is_available()
    dev, backend = (torch.device("cuda"), "cuda") if cuda else (torch.device("cpu"), "cpp")
    gen = torch.Generator().manual_seed(args.seed)
    calib = torch.randn(16, 3, 224, 224, generator=gen)
    x = torch.randn(args.images, 3, 224, 224, generator=gen)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'no GPU: dry run'}, "
          f"{torch.get_num_threads()} CPU threads", flush=True)
    failed = False
    for arch in args.models.split(","):
        torch.manual_seed(args.seed)
        model = getattr(torchvision.models, arch)(weights=None).eval()
        for mult in args.multipliers.split(","):
            t0 = time.perf_counter()
            _, cpp = approximate(model, mult, calib, backend="cpp")
            _, other = approximate(model, mult, calib, backend=backend)
            a, b = cpp.state_dict(), other.state_dict()
            if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
                print(f"{arch} {mult}: the two conversions' scales or weights differ", flush=True)
                failed = True
                continue
            other = other.to(dev)
            diff_images, worst = 0, 0.0
            with torch.no_grad():
                for i in range(0, len(x), args.batch):
                    xb = x[i:i + args.batch]
                    la, lb = cpp(xb), other(xb.to(dev)).cpu()
                    differ = (la != lb).any(dim=1)
                    diff_images += int(differ.sum())
                    worst = max(worst, float((la.double() - lb.double()).abs().max()))
            picks = collections.Counter(auto_picks(other).values()) if cuda else {}
            print(f"{arch} {mult}: {diff_images} of {len(x)} images' logits differ (max |diff| {worst:g}); "
                  f"{time.perf_counter() - t0:.0f} s; cuda picks {dict(picks)}", flush=True)
            failed |= diff_images > 0
    print("cuda == cpp:", "NO" if failed else "bit for bit on every image")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
