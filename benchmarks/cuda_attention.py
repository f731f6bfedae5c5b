"""GPU timings of approx::lut_bmm, attention's LUT matmuls, per kernel variant, on ViT-B/16 shapes.

    python benchmarks/cuda_attention.py [--images 64] [--repeat 10] [--warmup 2] [--variants g3_k64_pad,g3_pad]
                                        [--models vit_b16,vit_small] [--out FILE.json]

The variants are the CUDA kernel's layouts (approx::lut_bmm_variants; runner.ops.lut_bmm_variant selects one,
cuda/lut_bmm_cuda.cu describes them; lut_bmm times the first four and keeps the fastest). In one process:

1. Checks, per variant, bit for bit: against the pure reference (runner.reference) and the current kernel
   (ops.lut_bmm on CUDA) on small random shapes (batch 1, odd M / N / K, K not a multiple of 32 or of 4,
   misaligned code pointers, several tiles) for each table range the kernel treats apart (signed int16
   products: S16; unsigned a with products beyond int16: U16; products beyond 16 bits: G32, signed and
   unsigned), then against the CPU kernel on both products of one ViT-B/16 layer at 2 images with the exact
   tables.
2. Timings, per variant, model shape, product (qk = Q.K^T: [197 x 64] x [197 x 64]^T, av = P.V:
   [197 x 197] x [64 x 197]^T), table (exact mul8s with int8 codes; for P.V also exact mul8u with P as uint8
   codes) and code distribution ("uniform": every code equally likely, the most bank conflicts; "attention":
   Q, K, V codes from a normal of std 32 codes, P from a softmax over the tokens; "narrow": std 8 codes, P
   concentrated likewise): `warmup` calls, then the median of `repeat` CUDA-event timings, in T MAC/s;
   torch.bmm fp32 / bf16 (cuBLAS) on the same shapes for scale.

Prints one table (a row per variant, a column per timed case) and writes a JSON file (--out, else
$OUT/cuda_attention.json where $OUT is set). A variant that fails (an exception, a mismatch) is reported and the
others go on; a failure that leaves the CUDA context unusable (an illegal address) ends the in-process run and
the remaining variants run in a fresh process each. The bar: >= 2 T MAC/s on ViT-B/16 (64 images, 12 heads,
197 tokens, head dim 64) on one H100. Exit status 1 when any variant mismatched or failed. Needs the CUDA build
of runner._C; no Hydra.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from runner import ops, reference
from runner.bench import ATTENTION_SHAPES, attention_matmul_shapes, device_timer, matmul_codes
from runner.multipliers.core import exact_lut
from runner.ops_autograd import sign_magnitude_table

# (B, M, N, K): batch 1, odd sizes, K below / not a multiple of 32, K % 4 == 0 (word staging) and not, tiles
# that do not fill, several row and column tiles, the ViT products at 2 heads
SMALL_SHAPES = [(1, 1, 1, 1), (1, 7, 5, 3), (2, 17, 9, 33), (1, 33, 31, 95), (3, 65, 70, 64), (2, 41, 203, 100),
                (1, 300, 257, 40), (2, 197, 64, 197), (2, 197, 197, 64)]


def small_tables(gen):
    """(name, lut, a signed): one per mode of the kernel (and the unsigned form of S16 and G32)."""
    r = lambda lo, hi: torch.randint(lo, hi, (256, 256), generator=gen, dtype=torch.int32)  # noqa: E731
    return [("s16 signed", r(-(2**14), 2**14), True), ("s16 unsigned", r(0, 2**14), False),
            ("u16 unsigned (> int16)", r(2**15, 2**16), False), ("g32 signed", r(-(2**31), 2**31 - 1), True),
            ("g32 unsigned", r(-(2**31), 2**31 - 1), False)]


def small_operands(gen, shape, signed, misaligned=False):
    nb, m, n, k = shape
    a = torch.randint(-128, 128, (nb, m, k), generator=gen).to(torch.int8) if signed else \
        torch.randint(0, 256, (nb, m, k), generator=gen).to(torch.uint8)
    b = torch.randint(-128, 128, (nb, n, k), generator=gen).to(torch.int8)
    a, b = a.cuda(), b.cuda()
    if misaligned:  # contiguous, but the data one byte past an aligned address: byte staging even where K % 4 == 0
        a = torch.empty(a.numel() + 1, dtype=a.dtype, device="cuda")[1:].view(a.shape).copy_(a)
        b = torch.empty(b.numel() + 1, dtype=b.dtype, device="cuda")[1:].view(b.shape).copy_(b)
    return a, b


def vit_tables():
    return {"mul8s_exact": (exact_lut(True), True), "mul8u_exact": (exact_lut(False), False)}


def table_for(op, lut, signed):
    """Q.K^T on an unsigned multiplier runs its sign-magnitude table with int8 codes (runner.ops_autograd)."""
    return sign_magnitude_table(lut) if op == "qk" and not signed else lut


def operands(op, shape, signed, dist, gen):
    """Codes on the GPU (generated there: the 64-image P is 30 M elements), as `approx-run bench` draws them."""
    return matmul_codes(op, shape, dist, gen, signed=signed, device="cuda")


_CHECKS = []


def check_cases():
    """(description, a, b, lut on the GPU, wanted output, the current kernel's output, what `want` is), built once."""
    if _CHECKS:
        return _CHECKS
    gen = torch.Generator().manual_seed(1)
    cases = [(s, False) for s in SMALL_SHAPES] + [((2, 19, 23, 64), True), ((1, 197, 64, 196), True)]
    for name, lut, signed in small_tables(gen):
        lut_d = lut.cuda()
        for shape, misaligned in cases:
            a, b = small_operands(gen, shape, signed, misaligned)
            want = reference.reference_lut_bmm(a.cpu(), b.cpu(), lut)
            cur = ops.lut_bmm(a, b, lut_d, backend="cuda").cpu()
            _CHECKS.append((f"{name} {shape}{' misaligned' if misaligned else ''}", a, b, lut_d, want, cur,
                            "reference"))
    heads, tokens, hd = ATTENTION_SHAPES["vit_b16"]
    gen = torch.Generator(device="cuda").manual_seed(2)
    for tname, (lut, signed) in vit_tables().items():
        for op, shape in attention_matmul_shapes(2, heads, tokens, hd).items():
            for dist in ("uniform", "attention"):
                a, b = operands(op, shape, signed, dist, gen)
                t = table_for(op, lut, signed)
                want = ops.lut_bmm(a.cpu(), b.cpu(), t, backend="cpp")
                cur = ops.lut_bmm(a, b, t.cuda(), backend="cuda").cpu()
                _CHECKS.append((f"vit_b16 {op} {tname} {dist} (2 images)", a, b, t.cuda(), want, cur, "cpp kernel"))
    bad = [c[0] for c in _CHECKS if not torch.equal(c[4], c[5])]
    if bad:
        print(f"  the current kernel (lut_bmm on CUDA) differs from the reference / cpp kernel on: {bad}")
    return _CHECKS


def check_variant(v, lines):
    """Mismatches of variant v (name) against the reference (or the cpp kernel on ViT shapes) and the current
    kernel; appends a line per mismatch."""
    bad = 0
    for desc, a, b, lut_d, want, cur, what in check_cases():
        out = ops.lut_bmm_variant(a, b, lut_d, v, backend="cuda").cpu()
        ok_ref, ok_cur = torch.equal(out, want), torch.equal(out, cur)
        if not (ok_ref and ok_cur):
            bad += 1
            lines.append(f"{v}: {desc}: == {what} {ok_ref}, == current kernel {ok_cur} "
                         f"({int((out != want).sum())} of {want.numel()} differ from the {what})")
    return bad


def time_cases(models, images):
    """(key, model, op, shape, table name, lut, signed, dist) of every timed case."""
    cases = []
    for model in models:
        heads, tokens, hd = ATTENTION_SHAPES[model]
        for op, shape in attention_matmul_shapes(images, heads, tokens, hd).items():
            for tname, (lut, signed) in vit_tables().items():
                if op == "qk" and not signed:
                    continue  # the sign-magnitude table of mul8u: products beyond int16, the G32 path
                for dist in ("uniform", "attention", "narrow"):
                    key = f"{op} {'s8' if signed else 'u8'} {dist}" + ("" if model == "vit_b16" else f" {model}")
                    cases.append((key, model, op, shape, tname, lut, signed, dist))
    return cases


def run_variants(variants, args, results):
    """Check and time each variant in this process; returns the variants not run (the CUDA context broke)."""
    timer = device_timer(torch.device("cuda"))
    cases = time_cases(args.models, args.images)
    inputs = {}
    for i, v in enumerate(variants):
        res = results.setdefault(v, dict(variant=v, check="", mismatches=None, error="", tmacs={}, us={}))
        try:
            lines = []
            t0 = time.time()
            res["mismatches"] = check_variant(v, lines)
            res["check"] = "ok" if res["mismatches"] == 0 else "MISMATCH"
            res["check_lines"] = lines
            for line in lines[:10]:
                print("  " + line)
            print(f"check {v:16s} {res['check']} ({time.time() - t0:.1f} s)", flush=True)
            for key, model, op, shape, tname, lut, signed, dist in cases:
                nb, m, n, k = shape
                if (model, op, tname, dist) not in inputs:
                    gen = torch.Generator(device="cuda").manual_seed(3)
                    inputs[(model, op, tname, dist)] = (*operands(op, shape, signed, dist, gen),
                                                        table_for(op, lut, signed).cuda())
                a, b, t = inputs[(model, op, tname, dist)]
                fn = lambda: ops.lut_bmm_variant(a, b, t, v, backend="cuda")  # noqa: E731
                for _ in range(args.warmup):
                    timer(fn)
                us = statistics.median(timer(fn) for _ in range(args.repeat))
                res["us"][key], res["tmacs"][key] = us, nb * m * n * k / us / 1e6
        except Exception as e:  # noqa: BLE001 - report and go on
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            res["traceback"] = traceback.format_exc()
            print(f"variant {v}: FAILED: {res['error']}", flush=True)
            try:
                torch.zeros(1, device="cuda").add_(1).item()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - the context is gone: the rest in fresh processes
                res["error"] += " (CUDA context unusable afterwards)"
                return variants[i + 1:]
    return []


def run_isolated(variants, args, results):
    """Each variant in its own process (after a failure broke this process's CUDA context)."""
    for v in variants:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--variants", v, "--images", str(args.images),
                   "--repeat", str(args.repeat), "--warmup", str(args.warmup), "--models", ",".join(args.models),
                   "--out", out, "--no-torch-bmm", "--child"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            sys.stdout.write(proc.stdout)
            try:
                with open(out) as f:
                    results[v] = json.load(f)["variants"][0]
            except (OSError, ValueError, IndexError, KeyError):
                results[v] = dict(variant=v, check="", mismatches=None, tmacs={}, us={},
                                  error=f"child process exited {proc.returncode}: {proc.stderr.strip()[-300:]}")


def torch_bmm_rows(args):
    timer = device_timer(torch.device("cuda"))
    rows = {}
    for model in args.models:
        heads, tokens, hd = ATTENTION_SHAPES[model]
        for op, (nb, m, n, k) in attention_matmul_shapes(args.images, heads, tokens, hd).items():
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(nb, m, k, device="cuda", dtype=dtype)
                y = torch.randn(nb, k, n, device="cuda", dtype=dtype)
                for _ in range(args.warmup):
                    timer(lambda: torch.bmm(x, y))
                us = statistics.median(timer(lambda: torch.bmm(x, y)) for _ in range(args.repeat))
                name = f"torch.bmm {str(dtype)[6:]}"
                rows.setdefault(name, {})[f"{op} {model}"] = nb * m * n * k / us / 1e6
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", help="comma-separated names (default: every variant of the build)")
    ap.add_argument("--models", default="vit_b16", help=f"comma-separated, of {', '.join(ATTENTION_SHAPES)}")
    ap.add_argument("--out")
    ap.add_argument("--no-torch-bmm", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.models = args.models.split(",")
    names = ops.lut_bmm_variants()
    if not names:
        raise SystemExit("runner._C has no approx::lut_bmm_variants: rebuild it")
    variants = args.variants.split(",") if args.variants else list(names)
    unknown = [v for v in variants if v not in names]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; this build has {', '.join(names)}")
    out = args.out or (os.path.join(os.environ["OUT"], "cuda_attention.json") if os.environ.get("OUT") else None)
    print(f"device: {torch.cuda.get_device_name()}; variants: {', '.join(variants)}", flush=True)
    t0 = time.time()
    results = {}
    rest = run_variants(variants, args, results)
    if rest:
        print(f"the CUDA context broke: {', '.join(rest)} run in fresh processes", flush=True)
        run_isolated(rest, args, results)
    bmm = {} if args.no_torch_bmm else torch_bmm_rows(args)
    keys = [c[0] for c in time_cases(args.models, args.images)]
    if not args.child:
        print(f"\nT MAC/s (median of {args.repeat} after {args.warmup} warm-ups), {args.images} images; "
              f"columns: product, table, codes")
        print(f"{'variant':16s} {'check':9s} " + " ".join(f"{k:>17s}" for k in keys))
        for v in variants:
            r = results[v]
            cells = " ".join(f"{r['tmacs'][k]:17.3f}" if k in r["tmacs"] else f"{'-':>17s}" for k in keys)
            print(f"{v:16s} {r['check'] or 'FAILED':9s} {cells}" + (f"  {r['error']}" if r["error"] else ""))
        for name, row in bmm.items():
            print(f"{name:24s} " + "  ".join(f"{k}: {t:.2f}" for k, t in row.items()) + "  (T FLOP-pairs/s)")
        print(f"({time.time() - t0:.0f} s)")
    failed = [v for v in variants if results[v]["error"] or results[v]["mismatches"]]
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), images=args.images, repeat=args.repeat,
                           warmup=args.warmup, columns=keys, variants=[results[v] for v in variants],
                           torch_bmm=bmm, failed=failed), f, indent=1)
        if not args.child:
            print(f"wrote {out}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
