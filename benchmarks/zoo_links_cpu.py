"""Whole-model time with and without requant=integer's hand-offs between layers, on the CPU, in one process.

    PYTHONPATH=. python benchmarks/zoo_links_cpu.py [--models resnet8,mobilenetv2] [--batch 256]
        [--repeats 15] [--warmup 2] [--threads 2] [--out benchmarks/zoo_links_cpu.csv]

Each model (random-init weights with BatchNorm statistics set away from 0/1; speed does not depend on
training) is converted as compare converts it (BatchNorm and the input normalisation folded, activations
calibrated on mnist5k training images, exact signed table, backend cpp, requant=integer), then timed on
mnist5k test images two ways: `linked`, the links runner.layers.link_consumers finds, and `unlinked`, every
layer dequantizing to fp32 (what models without stages() got before the links were found from the traced
forward). A shared machine's load drifts within minutes, so the two alternate within every repeat (their
order swapped each repeat) after `--warmup` passes each; the median of `--repeats` is reported. The two
models' logits must agree on every image's prediction up to the rare rounding ties of the two paths."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _unlinked(model):
    import copy

    from runner.layers import quantized_layers

    out = copy.deepcopy(model)
    for m in quantized_layers(out).values():
        object.__setattr__(m, "_consumer", None)
        m._requant_cache = None
    return out


def _random_bn(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.3)
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
    return model.eval()


@torch.no_grad()
def bench(name: str, args, data) -> list[dict]:
    from runner.config import compose
    from runner.layers import integer_links, quantized_layers, quantized_models
    from runner.models import build_model
    from runner.multipliers import resolve
    from runner.quant import QuantConfig

    cfg = compose("compare", [f"model={name}"])
    torch.manual_seed(0)
    model = _random_bn(build_model(cfg.model, data.mean, data.std))
    _, linked, _ = quantized_models(model, resolve("exact"), QuantConfig(), data.train_x, backend="cpp")
    unlinked = _unlinked(linked)
    x = data.test_x[:args.batch].contiguous()
    variants = {"linked": linked, "unlinked": unlinked}
    agree = (linked(x).argmax(1) == unlinked(x).argmax(1)).float().mean().item()
    times = {v: [] for v in variants}
    for _ in range(args.warmup):
        for m in variants.values():
            m(x)
    for r in range(args.repeats):
        for v in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            t = time.perf_counter()
            variants[v](x)
            times[v].append((time.perf_counter() - t) * 1e3)
    rows = []
    for v, ts in times.items():
        rows.append({"model": name, "variant": v, "layers": len(quantized_layers(linked)),
                     "integer_links": len(integer_links(variants[v])), "batch": args.batch,
                     "threads": torch.get_num_threads(), "warmup": args.warmup, "repeats": args.repeats,
                     "median_ms": round(statistics.median(ts), 2), "min_ms": round(min(ts), 2),
                     "prediction_agreement": round(agree, 4)})
    rows[0]["x_unlinked_time"] = round(rows[0]["median_ms"] / rows[1]["median_ms"], 3)
    rows[1]["x_unlinked_time"] = 1.0
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet8,mobilenetv2")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "zoo_links_cpu.csv"))
    args = parser.parse_args(argv)
    from runner.data import load_mnist5k

    torch.set_num_threads(args.threads)
    data = load_mnist5k(seed=0)
    rows = [row for name in args.models.split(",") for row in bench(name, args, data)]
    table = pd.DataFrame(rows)
    print(table.to_string(index=False))
    table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
