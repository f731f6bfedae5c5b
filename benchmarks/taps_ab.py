"""Whole-model A/B of auto's timed taps layout, in one process: ResNet-50 / ResNet-18 at batch 64 with auto in every
layer (A: each stride-1 3x3 conv timed against its taps on its first call, the convs alone) against the same
converted model with those convs named to the `expanded_window` config auto picked for them as given (B: the
window, which applies each conv's end in its stores). Both replayed from CUDA graphs, alternated, outputs checked
equal. Results: benchmarks/imagenet.md, "Stride-1 3x3 convs: the taps timed against the shape as given".

    python3 benchmarks/taps_ab.py [--models resnet50,resnet18] [--batch 64] [--repeats 20]
"""
import argparse
import copy
import statistics

import torch
import torchvision

from runner.evaluate import device_timer
from runner.graphs import GraphedForward
from runner.layers import approximate, auto_picks

# the stride-1 3x3 convs on 28x28 and 14x14 planes (ResNet-18: and 56x56), with auto's picks as given on an H200
WINDOW = {
    "resnet50": {**{f"layer2.{i}.conv2": "expanded_window_x7_c18" for i in (1, 2, 3)},
                 **{f"layer3.{i}.conv2": "expanded_window_x7_c21" for i in range(1, 6)}},
    "resnet18": {**{f"layer1.{i}.conv{j}": "expanded_window_c13" for i in (0, 1) for j in (1, 2)},
                 **{n: "expanded_window_c13" for n in ("layer2.0.conv2", "layer2.1.conv1", "layer2.1.conv2")},
                 **{n: "expanded_window_x7_c18" for n in ("layer3.0.conv2", "layer3.1.conv1", "layer3.1.conv2")}},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,resnet18")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    timer = device_timer(torch.device("cuda"))
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None).eval()
        _, auto = approximate(model, "exact", torch.randn(16, 3, 224, 224), backend="cuda")
        window = copy.deepcopy(auto)
        for layer, module in window.named_modules():
            if layer in WINDOW[name]:
                module.algo = WINDOW[name][layer]
        auto, window = auto.cuda(), window.cuda()
        x = torch.randn(args.batch, 3, 224, 224, device="cuda")
        with torch.no_grad():
            assert torch.equal(auto(x), window(x)), "the two models differ"
            graphs = {"A auto": GraphedForward(auto), "B window named": GraphedForward(window)}
            for g in graphs.values():
                g(x), g(x)
            picks = auto_picks(auto)
            print(name, "auto's picks:", {layer: picks[layer] for layer in WINDOW[name]})
            ms = {k: [] for k in graphs}
            for _ in range(args.repeats):
                for k, g in graphs.items():
                    ms[k].append(timer(lambda g=g: g(x)) / 1e3)
        for k, v in ms.items():
            print(f"{name} batch {args.batch} {k}: median {statistics.median(v):.2f} ms (min {min(v):.2f}, "
                  f"max {max(v):.2f})")
        ratio = [b / a for a, b in zip(*ms.values())]
        print(f"{name} B / A: median {statistics.median(ratio):.4f} (min {min(ratio):.4f}, max {max(ratio):.4f})")


if __name__ == "__main__":
    main()
