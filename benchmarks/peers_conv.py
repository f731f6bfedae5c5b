"""Approximate-multiplier convolution kernels on ResNet-50's conv shapes, ours beside the peers', in one process.

    TORCH_CUDA_ARCH_LIST=9.0 python benchmarks/peers_conv.py --approxtorch /tmp/peers/approxtorch \\
        --torchapprox /tmp/peers/torchapprox/src --batch 64 --csv peers_conv.csv
    python benchmarks/peers_conv.py --device cpu --torchapprox /tmp/peers/torchapprox/src   # dry run, here

Shapes: every distinct Conv2d call of torchvision's resnet50 (random weights) on 3x224x224 at --batch, traced
with forward hooks and deduplicated (count: how many of the model's convs have the shape). Per shape: random
codes (activations int8 in [-128, 127], weights int8 in [-127, 127]) and one signed table per --multiplier, then

  ours         runner.ops.lut_conv2d(a, w, lut, ..., backend="cuda", algo="auto"): int8 codes, the int32
               [256, 256] table indexed lut[a + 128][w + 128], int32 sums.
  approxtorch  what ApproxTorch's Conv2d_int8 runs on its quantized image (nn/bgemm_int8.py, _conv2d_int8_ste):
               ops.im2col_u8 (int8 image -> uint8 LUT indices [N, C*kh*kw, L], padding -> index 128 = value 0)
               then ops.bgemm_fake_int8_claude(x_u8, w, lut): w float32 [O, C*kh*kw] holding the integer
               codes (its prepass maps round(w) + 128 to an index), lut float32 [65536] indexed
               (x + 128) * 256 + (w + 128), i.e. our table's layout flattened; sums accumulate in fp32 (exact while
               partial sums stay below 2^24, which these random codes do) and come back float32 [N, O, L].
  torchapprox  torchapprox.operators.conv2d._im2col_conv2d (what its ApproxConv2dOp runs after quantizing): float
               inputs holding the codes (its x_q / w_q after round(x / scale + zero_point); here scale 1 and zero
               point 0, so they quantize exactly to our codes), unfold, .char(), its ApproxGeMM with an int32
               [256, 256] table indexed lut[w & 0xFF][x & 0xFF] (weight first, two's-complement bytes; we pass
               our table transposed and permuted by index ^ 0x80), int32 sums returned as float32 [N, O, L].

Each peer's result is compared with ours element by element (exactly; ours is checked against the oracle,
runner.reference.reference_lut_conv2d, on the first --check-images images). A peer whose sums differ is reported
"wrong products: N of M elements differ" and not timed. The correct ones are timed alternated (each repeat
calls every implementation once, in turn) with CUDA events after --warmup rounds (runner.evaluate.device_timer:
a sleep kernel queued ahead so the events time the device's work); the median of --repeat. T MAC/s = MACs /
median time; ours_x = this row's median time over ours' (ours' speed over this implementation's);
x_fastest_peer = the fastest correct peer's median time over this row's (this implementation's speed over the
fastest correct peer's). The peers' extensions are built first, in child processes, both at once, within
--build-timeout seconds; a peer that cannot be built or loaded is reported with the reason, and the rest still
runs. The CSV is rewritten after every shape.

--device cpu (a dry run of the harness on a machine without a GPU): ours on the cpp backend against the oracle on
the full batch, TorchApprox on its CPU GEMM (its CPU backend JIT-builds without a GPU), ApproxTorch skipped (its
LUT kernels are CUDA-only); three small shapes by default (--batch 1).
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402

PEERS = ("approxtorch", "torchapprox")
FIELDS = ["shape", "layer", "count", "input_shape", "weight_shape", "stride", "padding", "batch", "macs",
          "multiplier", "impl", "device", "status", "note", "median_ms", "min_ms", "tmacs", "ours_x",
          "fastest_peer", "x_fastest_peer"]


def conv_shapes(batch: int, model: str = "resnet50") -> list[dict]:
    """Distinct Conv2d calls of the torchvision model on 3x224x224 (traced at batch 1, random weights), in
    first-seen order, at `batch`: input/weight shapes, stride, padding, dilation, groups, output size, MACs, how
    many convs share the shape and the first one's name."""
    import torchvision

    from runner.bench_layers import layer_inputs
    from runner.reference import conv_output_size

    net = getattr(torchvision.models, model)(weights=None).eval()
    seen: dict[tuple, dict] = {}
    for name, a in layer_inputs(net, torch.zeros(1, 3, 224, 224)).items():
        mod = net.get_submodule(name)
        if not isinstance(mod, torch.nn.Conv2d):
            continue
        key = (tuple(a.shape[1:]), tuple(mod.weight.shape), mod.stride, mod.padding, mod.dilation, mod.groups)
        if key in seen:
            seen[key]["count"] += 1
        else:
            seen[key] = {"layer": name, "count": 1}
    shapes = []
    for i, ((chw, wshape, stride, padding, dilation, groups), v) in enumerate(seen.items()):
        ho, wo = conv_output_size(chw[1], chw[2], wshape[2], wshape[3], stride, padding, dilation)
        macs = batch * wshape[0] * ho * wo * math.prod(wshape[1:])
        shapes.append({"shape": i, "layer": v["layer"], "count": v["count"], "a_shape": (batch, *chw),
                       "w_shape": wshape, "stride": stride, "padding": padding, "dilation": dilation,
                       "groups": groups, "out_hw": (ho, wo), "macs": macs})
    return shapes


def pick_small(shapes: list[dict]) -> list[dict]:
    """The dry run's shapes: the smallest (by MACs) 1x1 stride-1 conv, 3x3 conv and stride-2 conv."""
    picks = []
    for pred in (lambda s: s["w_shape"][2:] == (1, 1) and s["stride"] == (1, 1),
                 lambda s: s["w_shape"][2:] == (3, 3),
                 lambda s: s["stride"] == (2, 2)):
        cands = [s for s in shapes if pred(s) and s not in picks]
        if cands:
            picks.append(min(cands, key=lambda s: s["macs"]))
    return sorted(picks, key=lambda s: s["shape"])


def select_shapes(spec: str, batch: int, device: torch.device) -> list[dict]:
    """--shapes: r50 (all distinct shapes; on --device cpu three small ones), r50:all, r50:small, or
    r50:I,J,... (indices into the distinct shapes, as printed)."""
    name, _, which = spec.partition(":")
    if name != "r50":
        raise SystemExit(f"--shapes {spec!r}: only r50, r50:all, r50:small or r50:I,J,... are known")
    shapes = conv_shapes(batch)
    which = which or ("small" if device.type == "cpu" else "all")
    if which == "all":
        return shapes
    if which == "small":
        return pick_small(shapes)
    idx = [int(i) for i in which.split(",")]
    bad = [i for i in idx if not 0 <= i < len(shapes)]
    if bad:
        raise SystemExit(f"--shapes: no shape index {bad}; resnet50 has {len(shapes)} distinct conv shapes")
    return [shapes[i] for i in idx]


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as one short line: a compiler's first error line where the build log has one."""
    text = f"{type(exc).__name__}: {exc}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() and not ln.startswith(("ninja:", "FAILED"))]
    head = lines[0] if lines else type(exc).__name__
    out = head if not errs or errs[0] == head else f"{head} ... {errs[0]}"
    return out[:limit]


# --- the implementations: each makes a call (no arguments) from the shape's codes, and a converter of its
# result to our layout [B, N, Ho, Wo] for the exact comparison -------------------------------------------------

class Ours:
    name = "ours"

    def __init__(self, backend: str):
        from runner import ops

        self.ops, self.backend = ops, backend

    def prepare(self, s, a, w, lut):
        ops, backend = self.ops, self.backend
        return (lambda: ops.lut_conv2d(a, w, lut, s["stride"], s["padding"], s["dilation"], s["groups"],
                                       backend=backend, algo="auto")), (lambda y: y)


class ApproxTorch:
    name = "approxtorch"

    def __init__(self, src: str, device: torch.device):
        if device.type != "cuda":
            raise RuntimeError("its LUT conv kernels (im2col_u8, bgemm_fake_int8_claude) are CUDA-only")
        self.ops = peers.load_approxtorch(src)

    def prepare(self, s, a, w, lut):
        if s["groups"] != 1:
            raise NotImplementedError("groups != 1 (its depthwise path is a separate kernel, not run here)")
        ops = self.ops
        kh, kw = s["w_shape"][2:]
        wf = w.reshape(w.shape[0], -1).to(torch.float32).contiguous()  # its layers pass float codes [O, K]
        lutf = lut.to(torch.float32).reshape(-1).contiguous()         # [(x + 128) * 256 + (w + 128)]
        geom = ((kh, kw), s["stride"], s["padding"], s["dilation"])

        def call():
            return ops.bgemm_fake_int8_claude(ops.im2col_u8(a, *geom), wf, lutf)
        b, n, (ho, wo) = a.shape[0], w.shape[0], s["out_hw"]
        return call, (lambda y: y.view(b, n, ho, wo))


def torchapprox_table(lut: torch.Tensor) -> torch.Tensor:
    """Our signed table (lut[a + 128][w + 128]) in TorchApprox's layout: lut_ta[w & 0xFF][a & 0xFF]."""
    perm = torch.arange(256, device=lut.device) ^ 0x80  # two's-complement byte -> value + 128
    return lut.t()[perm][:, perm].to(torch.int32).contiguous()


class TorchApprox:
    name = "torchapprox"

    def __init__(self, src: str, device: torch.device):
        self.conv2d = peers.import_torchapprox_conv(src)

    def prepare(self, s, a, w, lut):
        conv2d = self.conv2d
        n, _, kh, kw = w.shape
        args = conv2d.Conv2dArgs(in_channels=a.shape[1], out_channels=n, kernel_size=(kh, kw), stride=s["stride"],
                                 padding=s["padding"], dilation=s["dilation"], groups=s["groups"])
        xq, wq = a.to(torch.float32), w.to(torch.float32)  # = round(x / 1 + 0): exactly our codes
        lut_ta = torchapprox_table(lut)
        b, (ho, wo) = a.shape[0], s["out_hw"]
        return (lambda: conv2d._im2col_conv2d(xq, wq, args, lut_ta, (ho, wo), None)), \
            (lambda y: y.view(b, n, ho, wo))


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants, parents first (ninja starts each compiler in a process group of
    its own, so killing the build's group would leave them running)."""
    import os
    import signal

    tree, stack = [], [pid]
    while stack:
        p = stack.pop(0)
        tree.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                stack += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:
            pass
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def prebuild(args, device) -> dict:
    """Builds the peers' extensions in child processes, both at once, each within --build-timeout seconds (the
    in-process loads then find them in torch's extension cache). {name: why not} of those that failed."""
    import subprocess
    import tempfile

    here = str(Path(__file__).resolve().parent)
    jobs = {}
    for name, src, fn in (("approxtorch", args.approxtorch, "load_approxtorch"),
                          ("torchapprox", args.torchapprox, "import_torchapprox_conv")):
        if not src or (name == "approxtorch" and device.type != "cuda"):
            continue
        log = Path(tempfile.gettempdir()) / f"peers_conv_build_{name}.log"
        code = f"import sys; sys.path.insert(0, {here!r}); import peers; peers.{fn}({src!r})"
        with open(log, "w") as fh:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        jobs[name] = (proc, log)
    failed, t0 = {}, time.perf_counter()
    for name, (proc, log) in jobs.items():
        try:
            rc = proc.wait(timeout=max(1.0, args.build_timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            failed[name] = f"failed to build: not done in {args.build_timeout:.0f} s (log {log})"
        else:
            if rc != 0:
                lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                errs = [ln for ln in lines if "error" in ln.lower()]
                failed[name] = f"failed to build (exit {rc}): {(errs or lines or ['no output'])[0][:300]} (log {log})"
        print(f"{name}: " + (failed.get(name) or f"built in {time.perf_counter() - t0:.0f} s"), flush=True)
    return failed


def load_peers(args, device) -> tuple[dict, dict]:
    """{name: adapter} of the peers that loaded, {name: why not} of the others."""
    loaded = {}
    failed = prebuild(args, device) if args.build_timeout > 0 else {}
    for name, cls, src in (("approxtorch", ApproxTorch, args.approxtorch),
                           ("torchapprox", TorchApprox, args.torchapprox)):
        if name in failed:
            continue
        if not src:
            failed[name] = f"not run: no --{name} directory given"
            continue
        t0 = time.perf_counter()
        try:
            loaded[name] = cls(src, device)
            print(f"{name}: loaded from {src} in {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as exc:  # noqa: BLE001  (a peer that cannot load is reported; the rest runs)
            failed[name] = f"failed to load: {one_line(exc)}"
            print(f"{name}: {failed[name]}", flush=True)
            if args.verbose:
                traceback.print_exc()
    return loaded, failed


def compare(ref: torch.Tensor, got: torch.Tensor) -> str:
    """'' when got holds exactly ref's sums, else the 'wrong products' line."""
    if tuple(got.shape) != tuple(ref.shape):
        return f"wrong shape: {list(got.shape)}, expected {list(ref.shape)}"
    r, g = ref.to(torch.float64), got.to(torch.float64)
    bad = r != g
    n = int(bad.sum())
    if n == 0:
        return ""
    big = int((r.abs() >= 2 ** 24).sum())
    return (f"wrong products: {n} of {r.numel()} elements differ (max |diff| {float((r - g).abs().max()):.0f}; "
            f"{big} sums of ours reach 2^24)")


def run_shape(s, mult, impls, failed, args, device, gen) -> list[dict]:
    """The rows of one shape and table: check, then time the correct implementations alternated."""
    from runner.evaluate import device_timer
    from runner.reference import reference_lut_conv2d

    a = torch.randint(-128, 128, s["a_shape"], generator=gen, dtype=torch.int8).to(device)
    w = torch.randint(-127, 128, s["w_shape"], generator=gen, dtype=torch.int8).to(device)
    lut = mult.lut.to(device=device, dtype=torch.int32).contiguous()
    base = {"shape": s["shape"], "layer": s["layer"], "count": s["count"],
            "input_shape": "x".join(map(str, s["a_shape"])), "weight_shape": "x".join(map(str, s["w_shape"])),
            "stride": s["stride"][0], "padding": s["padding"][0], "batch": s["a_shape"][0], "macs": s["macs"],
            "multiplier": mult.name, "device": device.type}
    rows = {}
    calls = {}
    # ours first: its result is the reference for the peers; ours itself is checked against the oracle
    ours = impls["ours"]
    call, to_ours = ours.prepare(s, a, w, lut)
    ref = to_ours(call())
    k = args.check_images if device.type == "cuda" else a.shape[0]
    oracle = reference_lut_conv2d(a[:k].contiguous(), w, lut, s["stride"], s["padding"], s["dilation"], s["groups"])
    bad = compare(oracle, ref[:k])
    rows["ours"] = {**base, "impl": "ours", "status": "ok" if not bad else bad.replace("wrong", "ours: wrong", 1),
                    "note": f"checked against the oracle on {k} of {a.shape[0]} images"}
    if not bad:
        calls["ours"] = call
    for name in PEERS:
        if name in failed:
            rows[name] = {**base, "impl": name, "status": "skipped", "note": failed[name]}
            continue
        if not mult.signed:
            rows[name] = {**base, "impl": name, "status": "skipped",
                          "note": "unsigned table: our unsigned path takes sign-magnitude weights; the peers' int8 "
                                  "conv paths compared here take signed tables"}
            continue
        try:
            pcall, to_ours_layout = impls[name].prepare(s, a, w, lut)
            got = to_ours_layout(pcall())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001  (one peer failing a shape does not stop the others)
            rows[name] = {**base, "impl": name, "status": "failed", "note": one_line(exc)}
            if args.verbose:
                traceback.print_exc()
            continue
        bad = compare(ref, got)
        del got
        rows[name] = {**base, "impl": name, "status": "ok" if not bad else bad,
                      "note": "exactly ours' int32 sums on the whole batch" if not bad else "not timed"}
        if not bad:
            calls[name] = pcall
    del ref, oracle
    timer = device_timer(device)
    times = {n: [] for n in calls}
    for r in range(args.warmup + args.repeat):
        for n, fn in calls.items():
            us = timer(fn)
            if r >= args.warmup:
                times[n].append(us / 1e3)
    for n, ts in times.items():
        med = statistics.median(ts)
        rows[n].update(median_ms=med, min_ms=min(ts), tmacs=s["macs"] / (med / 1e3) / 1e12)
    peer_ms = {n: rows[n]["median_ms"] for n in PEERS if "median_ms" in rows.get(n, {})}
    fastest = min(peer_ms, key=peer_ms.get) if peer_ms else ""
    for n, row in rows.items():
        row["fastest_peer"] = fastest
        if "median_ms" in row:
            if "median_ms" in rows["ours"]:
                row["ours_x"] = row["median_ms"] / rows["ours"]["median_ms"]
            if fastest:
                row["x_fastest_peer"] = peer_ms[fastest] / row["median_ms"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [rows[n] for n in ("ours", *PEERS)]


def fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_shape(rows) -> None:
    r0 = rows[0]
    print(f"[{r0['shape']:2d}] {r0['layer']} (x{r0['count']}) a {r0['input_shape']} w {r0['weight_shape']} "
          f"s{r0['stride']} p{r0['padding']}, {r0['macs'] / 1e9:.2f} G MACs, {r0['multiplier']}; "
          f"fastest correct peer: {r0['fastest_peer'] or 'none'}")
    for r in rows:
        timed = f"{fmt(r.get('median_ms'), '9.3f')} ms {fmt(r.get('tmacs'), '7.3f')} T MAC/s " \
                f"ours/this {fmt(r.get('ours_x'), '6.2f')}x" if "median_ms" in r else ""
        print(f"     {r['impl']:12s} {timed:48s} {r['status']}" + (f" ({r['note']})" if r["status"] != "ok" else ""),
              flush=True)


def summary(rows) -> None:
    """Conv time over the shapes run (each shape's median times its count; with every shape: the whole
    model's convs) per implementation and table, where it ran every shape correctly."""
    by = {}
    for r in rows:
        by.setdefault((r["multiplier"], r["impl"]), []).append(r)
    print("\nover the shapes run, each distinct shape's median x its count in the model (all shapes: the model's "
          "convs), where timed on every shape:")
    for (mult, impl), rs in by.items():
        if all("median_ms" in r for r in rs):
            ms = sum(r["median_ms"] * r["count"] for r in rs)
            macs = sum(r["macs"] * r["count"] for r in rs)
            print(f"  {mult:12s} {impl:12s} {ms:10.2f} ms  {macs / (ms / 1e3) / 1e12:7.3f} T MAC/s")
        else:
            ok = sum("median_ms" in r for r in rs)
            print(f"  {mult:12s} {impl:12s} timed on {ok} of {len(rs)} shapes")


def write_csv(path: str, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=FIELDS)
        wr.writeheader()
        for r in rows:
            wr.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k, "")) for k in FIELDS})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--approxtorch", default="", help="ApproxTorch's repository root (a checkout or git archive)")
    ap.add_argument("--torchapprox", default="", help="TorchApprox's src/ directory")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, default=None, help="default 64 (cuda), 1 (cpu)")
    ap.add_argument("--shapes", default="r50", help="r50, r50:all, r50:small or r50:I,J,...")
    ap.add_argument("--repeat", type=int, default=None, help="timed calls per implementation (default 10, cpu 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3, cpu 1)")
    ap.add_argument("--multiplier", default="exact,mul8s_1L2J", help="comma-separated tables (signed for peers)")
    ap.add_argument("--check-images", type=int, default=1, help="images of the batch ours is checked on (cuda)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (cpu)")
    ap.add_argument("--build-timeout", type=float, default=420,
                    help="seconds the peers' extension builds may take (in child processes; 0: build in-process)")
    ap.add_argument("--csv", default="", help="the rows, rewritten after every shape")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of failures")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.batch = args.batch or (1 if cpu else 64)
    args.repeat = args.repeat or (3 if cpu else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU visible (--device cpu runs the dry run)")

    from runner import _ext
    from runner.multipliers import resolve

    backend = "cpp" if cpu else "cuda"
    status = _ext.backend_status().get(backend)
    if status != "available":
        raise SystemExit(f"our {backend} backend: {status}")
    mults = [resolve(m) for m in args.multiplier.split(",")]
    shapes = select_shapes(args.shapes, args.batch, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"resnet50 conv shapes at batch {args.batch} ({len(shapes)} distinct), {name}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; warm-up {args.warmup}, median of {args.repeat}; tables "
          f"{', '.join(m.name for m in mults)}", flush=True)
    impls = {"ours": Ours(backend)}
    loaded, failed = load_peers(args, device)
    impls.update(loaded)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for mult in mults:
        for s in shapes:
            rs = run_shape(s, mult, impls, failed, args, device, gen)
            print_shape(rs)
            rows += rs
            if args.csv:  # after every shape: a run cut short keeps what it measured
                write_csv(args.csv, rows)
    summary(rows)
    if args.csv:
        print(f"wrote {args.csv} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
