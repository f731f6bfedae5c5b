"""GPU timings of named algos on one or more LeNet-5 layers, by kind of activation codes.

    python benchmarks/cuda_codes.py LAYERS ALGOS [KINDS]
    e.g. python benchmarks/cuda_codes.py fc2,fc3 auto,expanded_rows_r2_c1_m417 uniform,const

Kinds: uniform (all 256 codes), relu (half zeros), const (every code the same: each warp's
lookup is one address, so shared-memory bank conflicts vanish; the gap to uniform is what
conflicts cost), tapconst (every row the same codes, taps differ). Same timer and warm-up as
cuda_layers.py (median of 30, queued); any algo name the op accepts, including one
configuration such as expanded_rows_r2_c1_m417.
"""
import sys

import torch

from runner.multipliers.core import exact_lut
from cuda_layers import LAYERS, call, codes as layer_codes, macs, time_ms

KINDS = ("uniform", "relu", "const", "tapconst")


def codes(shape, kind, i, gen):
    a = layer_codes(shape, "relu" if kind == "relu" else "uniform", gen)
    if kind == "const":
        a.fill_(77 + i)
    elif kind == "tapconst":
        a[:] = a[0:1].clone()
    return a


def main():
    layers, algos = sys.argv[1].split(","), sys.argv[2].split(",")
    kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else KINDS
    import runner._C  # noqa: F401

    gen = torch.Generator(device="cuda").manual_seed(0)
    lut = exact_lut(signed=False).to("cuda")
    batch = 10000
    for name in layers:
        _, ashape, wshape = LAYERS[name]
        w = torch.randint(-127, 128, wshape, generator=gen, dtype=torch.int8, device="cuda")
        for kind in kinds:
            inputs = [codes((batch, *ashape), kind, i, gen) for i in range(3)]
            for algo in algos:
                try:
                    call(name, inputs[0], w, lut, algo)
                except RuntimeError as exc:
                    print(f"{name:6} {kind:8} {algo:28} does not run: {str(exc).splitlines()[0]}")
                    continue
                med, _, _ = time_ms(lambda a: call(name, a, w, lut, algo), inputs, 30)
                print(f"{name:6} {kind:8} {algo:28} {med * 1e3:8.1f} us "
                      f"{macs(name, batch) / med / 1e9:6.2f} T MAC/s", flush=True)


if __name__ == "__main__":
    main()
