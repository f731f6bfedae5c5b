"""GPU timings of approx::lut_bmm, attention's LUT matmuls, on ViT-B/16 and small-ViT shapes.

    python benchmarks/cuda_attention.py [--images 64] [--repeat 30] [--out FILE.json]

First a check: the CUDA kernel equals the CPU kernel bit for bit on both products of one ViT-B/16 layer at
2 images, for each table kind the kernel treats apart (exact mul8s: int16 table in shared memory; exact mul8u
with probabilities as uint8 codes: uint16 magnitudes; a random table with 32-bit products: int32 through L1).
Then per model shape, product (qk = Q.K^T, av = P.V), table kind and code distribution ("uniform": every code
equally likely, the most bank conflicts; "attention": Q, K, V codes from a normal of std 32 codes, P codes
from a softmax over 197 tokens, as calibrated attention produces): the median of `repeat` timings with CUDA
events after warm-up, rotating among 3 input sets, in T MAC/s; beside it torch.bmm in fp32 and bf16 on the
same shapes (cuBLAS) for scale. The bar: >= 2 T MAC/s on ViT-B/16 (64 images, 12 heads, 197 tokens, head
dim 64) on one H100. Needs the CUDA build of runner._C; no Hydra.
"""
import argparse
import json
import statistics

import torch

from runner import ops
from runner.bench import ATTENTION_SHAPES, attention_matmul_shapes, device_timer
from runner.multipliers.core import exact_lut
from runner.ops_autograd import sign_magnitude_table


def tables():
    gen = torch.Generator().manual_seed(0)
    return {"mul8s_exact": (exact_lut(True), True), "mul8u_exact": (exact_lut(False), False),
            "random_int32": (torch.randint(-(2**31), 2**31 - 1, (256, 256), generator=gen, dtype=torch.int32),
                             True)}


def operands(op, shape, signed, dist, gen):
    nb, m, n, k = shape
    if dist == "uniform":
        a = torch.randint(-128, 128, (nb, m, k), generator=gen, dtype=torch.int8)
        b = torch.randint(-128, 128, (nb, n, k), generator=gen, dtype=torch.int8)
        if op == "av":
            hi, dt = (128, torch.int8) if signed else (256, torch.uint8)
            a = torch.randint(0, hi, (nb, m, k), generator=gen, dtype=dt)
    else:
        normal = lambda s: (torch.randn(s, generator=gen) * 32).round().clamp_(-127, 127).to(torch.int8)  # noqa
        a, b = normal((nb, m, k)), normal((nb, n, k))
        if op == "av":
            p = torch.softmax(torch.randn((nb, m, k), generator=gen) * 2, dim=-1)
            qmax = 127 if signed else 255
            a = (p / p.amax() * qmax).round().to(torch.int8 if signed else torch.uint8)
    return a, b


def table_for(op, lut, signed):
    """Q.K^T on an unsigned multiplier runs its sign-magnitude table with int8 codes (runner.ops_autograd)."""
    return sign_magnitude_table(lut) if op == "qk" and not signed else lut


def check(lut_kinds):
    heads, tokens, hd = ATTENTION_SHAPES["vit_b16"]
    gen = torch.Generator().manual_seed(1)
    bad = 0
    for name, (lut, signed) in lut_kinds.items():
        for op, shape in attention_matmul_shapes(2, heads, tokens, hd).items():
            a, b = operands(op, shape, signed, "uniform", gen)
            t = table_for(op, lut, signed)
            ok = torch.equal(ops.lut_bmm(a.cuda(), b.cuda(), t.cuda(), backend="cuda").cpu(),
                             ops.lut_bmm(a, b, t, backend="cpp"))
            bad += not ok
            print(f"check {name:13s} {op}: cuda == cpp {'yes' if ok else 'NO'}")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args()
    lut_kinds = tables()
    bad = check(lut_kinds)
    timer = device_timer(torch.device("cuda"))
    rows = []
    for model, (heads, tokens, hd) in ATTENTION_SHAPES.items():
        for op, shape in attention_matmul_shapes(args.images, heads, tokens, hd).items():
            nb, m, n, k = shape
            macs = nb * m * n * k
            for dtype in (torch.float32, torch.bfloat16):
                x, y = torch.randn(nb, m, k, device="cuda", dtype=dtype), torch.randn(nb, k, n, device="cuda",
                                                                                       dtype=dtype)
                for _ in range(3):
                    timer(lambda: torch.bmm(x, y))
                us = statistics.median(timer(lambda: torch.bmm(x, y)) for _ in range(args.repeat))
                rows.append(dict(model=model, op=op, shape=list(shape), table=f"torch.bmm {str(dtype)[6:]}",
                                 dist="-", median_us=us, tmacs=macs / us / 1e6))
            for name, (lut, signed) in lut_kinds.items():
                for dist in ("uniform", "attention"):
                    gen = torch.Generator().manual_seed(2)
                    sets = [tuple(t.cuda() for t in operands(op, shape, signed, dist, gen)) for _ in range(3)]
                    table = table_for(op, lut, signed).cuda()
                    for i in range(3):
                        ops.lut_bmm(*sets[i], table, backend="cuda")
                    ts = [timer(lambda i=i: ops.lut_bmm(*sets[i % 3], table, backend="cuda"))
                          for i in range(args.repeat)]
                    us = statistics.median(ts)
                    rows.append(dict(model=model, op=op, shape=list(shape), table=name, dist=dist, median_us=us,
                                     tmacs=macs / us / 1e6))
    print(f"{'model':10s} {'op':3s} {'B,M,N,K':22s} {'table':18s} {'codes':10s} {'us':>10s} {'T MAC/s':>8s}")
    for r in rows:
        print(f"{r['model']:10s} {r['op']:3s} {','.join(map(str, r['shape'])):22s} {r['table']:18s} "
              f"{r['dist']:10s} {r['median_us']:10.1f} {r['tmacs']:8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), images=args.images, rows=rows, mismatches=bad), f,
                      indent=1)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
