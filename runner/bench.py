"""Benchmarks. Op level (this part): every LeNet-5 layer shape through each LUT backend, and attention's LUT
matmuls (bench_matmuls, with uniform and attention-like codes).

`bench_ops` times the approx ops alone on synthetic codes, one row per (backend, algo, layer,
batch, code distribution): min / median / mean microseconds over `repeats` calls after `warmup`
calls, the first (cold) call separately (it includes any per-weight setup such as the CPU
expanded table, which later calls reuse), and GMAC/s from the median.
"""
from __future__ import annotations

import copy
import statistics
import time

import pandas as pd
import torch

from runner import ops
from runner.errors import UserError, config_number
from runner.evaluate import device_timer  # noqa: F401  (benchmarks/ time with it as runner.bench.device_timer)
from runner.multipliers.core import exact_lut

# LeNet-5 layers as the approx ops see them: name, kind, activation shape without batch, weight shape.
LENET5_LAYERS = (
    ("conv1", "conv", (1, 28, 28), (6, 1, 5, 5)),
    ("conv2", "conv", (6, 12, 12), (16, 6, 5, 5)),
    ("fc1", "linear", (256,), (120, 256)),
    ("fc2", "linear", (120,), (84, 120)),
    ("fc3", "linear", (84,), (10, 84)),
)

DEFAULT_ALGOS = {"python": ("auto",), "cpp": ("direct", "expanded", "tiled"), "cuda": ("auto",)}
DISTRIBUTIONS = ("uniform", "relu")


def op_call_macs(kind, a_shape, w_shape, batch):
    """Multiply-accumulates of one timed op call on a batch (not runner.energy.layer_macs: a model's per-image
    MACs per layer)."""
    if kind == "linear":
        return batch * w_shape[0] * w_shape[1]
    ho = a_shape[1] - w_shape[2] + 1
    wo = a_shape[2] - w_shape[3] + 1
    return batch * w_shape[0] * ho * wo * w_shape[1] * w_shape[2] * w_shape[3]


def synthetic_codes(shape, signed, dist, gen):
    """'uniform': every code equally likely; 'relu': half the codes 0 (post-ReLU activations)."""
    if signed:
        a = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    else:
        a = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if dist == "relu":
        a = a.abs() if signed else a
        a[torch.rand(shape, generator=gen) < 0.5] = 0
    elif dist != "uniform":
        raise ValueError(f"unknown code distribution '{dist}'; valid: {', '.join(DISTRIBUTIONS)}")
    return a


def _timed(timer, fn, warm: int, reps: int, macs: int) -> dict:
    """One op's timing columns: the first (cold) call apart, then `warm` untimed calls, then `reps` timed ones."""
    first = timer(fn)
    for _ in range(warm):
        timer(fn)
    ts = [timer(fn) for _ in range(reps)]
    return dict(repeats=reps, macs=macs, first_us=first, min_us=min(ts), median_us=statistics.median(ts),
                mean_us=statistics.fmean(ts))


def bench_ops(backends=("python", "cpp"), batches=(1, 256, 10000), repeats=20, warmup=3, *,
              algos=None, distributions=DISTRIBUTIONS, signed=False, lut=None, layers=None,
              python_max_macs=20_000_000, python_repeats=2, seed=0) -> pd.DataFrame:
    """Time each LeNet-5 layer shape per backend; returns one row per measurement.

    backends: "python" (reference), "cpp", "cuda" (tensors on the current CUDA device).
    algos: {backend: names}; defaults to DEFAULT_ALGOS. lut: int32 [256, 256] (default: exact).
    The python reference is slow: it runs only where the layer has at most `python_max_macs`
    MACs, with at most `python_repeats` repeats and one warm-up call.
    """
    algos = {**DEFAULT_ALGOS, **(algos or {})}
    lut = exact_lut(signed) if lut is None else lut
    layers = [l for l in LENET5_LAYERS if layers is None or l[0] in layers]
    rows = []
    for backend in backends:
        device = torch.device("cuda" if backend == "cuda" else "cpu")
        timer = device_timer(device)
        lut_d = lut.to(device)
        for name, kind, a_shape, w_shape in layers:
            for batch in batches:
                macs = op_call_macs(kind, a_shape, w_shape, batch)
                reps, warm = repeats, warmup
                if backend == "python":
                    if macs > python_max_macs:
                        continue
                    reps, warm = min(repeats, python_repeats), min(warmup, 1)
                for dist in distributions:
                    gen = torch.Generator().manual_seed(seed)
                    a = synthetic_codes((batch, *a_shape), signed, dist, gen).to(device)
                    w = torch.randint(-127, 128, w_shape, generator=gen, dtype=torch.int8).to(device)
                    for algo in algos.get(backend, ("auto",)):
                        if kind == "conv":
                            fn = lambda: ops.lut_conv2d(a, w, lut_d, backend=backend, algo=algo)  # noqa: E731
                        else:
                            fn = lambda: ops.lut_linear(a, w, lut_d, backend=backend, algo=algo)  # noqa: E731
                        t = _timed(timer, fn, warm, reps, macs)
                        rows.append(dict(
                            backend=backend, algo=algo, layer=name, batch=batch, dist=dist,
                            signed=signed, device=str(device), threads=torch.get_num_threads(), **t,
                            gmacs=macs / t["median_us"] / 1e3 if t["median_us"] > 0 else float("nan"),
                        ))
    return pd.DataFrame(rows)


def bench_algos(backends, batches=(10000,), repeats=10, warmup=2, *, signed=False, seed=0) -> pd.DataFrame:
    """Every concrete variant of each backend on each LeNet-5 layer at each batch size: time, the
    workspace its prepared tables take, and for `auto` the variant it ran in the timed calls
    (approx::lut_algos, asked after them: the kernels' own choice function), or why a variant does
    not apply to that shape. The variants of one (layer, batch) are timed in interleaved rounds (each
    variant once per round, the order rotated each round), so a change of the machine's load during the
    measurement, and what ran just before, hit them alike."""
    rows = []
    for backend in backends:
        device = torch.device("cuda" if backend == "cuda" else "cpu")
        timer = device_timer(device)
        lut = exact_lut(signed).to(device)
        for name, kind, a_shape, w_shape in LENET5_LAYERS:
            for batch in batches:
                gen = torch.Generator().manual_seed(seed)
                a = synthetic_codes((batch, *a_shape), signed, "uniform", gen).to(device)
                w = torch.randint(-127, 128, w_shape, generator=gen, dtype=torch.int8).to(device)
                macs = op_call_macs(kind, a_shape, w_shape, batch)
                rows += _time_algos(backend, ("auto", *ops.backend_algos(backend)), kind, name, batch, macs, a, w,
                                    lut, device, timer, repeats, warmup)
    return pd.DataFrame(rows)


def _time_algos(backend, algos, kind, name, batch, macs, a, w, lut, device, timer, repeats, warmup) -> list[dict]:
    base = dict(backend=backend, layer=name, batch=batch, device=str(device), threads=torch.get_num_threads(),
                macs=macs)
    fns, rows = {}, {}
    for algo in algos:
        wa = w.clone()  # own weights: prepared tables are cached per weights tensor
        fn = ((lambda wa=wa, algo=algo: ops.lut_conv2d(a, wa, lut, backend=backend, algo=algo)) if kind == "conv"
              else (lambda wa=wa, algo=algo: ops.lut_linear(a, wa, lut, backend=backend, algo=algo)))
        try:
            fn()
            for _ in range(warmup):
                timer(fn)
        except RuntimeError as exc:  # a variant that does not apply to this shape says why
            rows[algo] = {**base, "algo": algo, "supported": False, "note": str(exc).splitlines()[0]}
            continue
        fns[algo] = (fn, wa)
    times = {algo: [] for algo in fns}
    order = list(fns)
    for r in range(repeats):  # each round starts one variant later: no variant always runs after the same one
        for algo in order[r % len(order):] + order[:r % len(order)]:
            times[algo].append(timer(fns[algo][0]))
    for algo, (_fn, wa) in fns.items():
        # the kernels' own account: workspace per variant, and auto's pick for these tensors
        info = {r["algo"]: r for r in ops.algo_table(a, wa, lut, backend=backend)}
        pick = next((r for r in info.values() if r["auto_pick"]), None)
        mine = pick if algo == "auto" else info.get(algo)
        ts = times[algo]
        med = statistics.median(ts)
        rows[algo] = {**base, "algo": algo, "auto_pick": pick["auto_pick_name"] if algo == "auto" and pick else "",
                      "supported": True, "median_us": med, "min_us": min(ts), "gmacs": macs / med / 1e3,
                      "workspace_mib": (mine["workspace_bytes"] if mine else float("nan")) / 2**20, "note": ""}
    return [rows[algo] for algo in algos]


def bench_models(model, multiplier, qcfg, calib_x, x, backends, *, batch_size, repeats, warmup,
                 python_repeats=1) -> pd.DataFrame:
    """The whole LeNet-5 over x: pytorch fp32 and fakequant on every device in play, approx on each backend."""
    from runner.evaluate import run_timed
    from runner.layers import quantized_models

    fq, _, stats = quantized_models(model, multiplier, qcfg, calib_x, backend="python")
    from runner.layers import convert_model
    from runner.models import fold_input_normalization

    folded = fold_input_normalization(model)
    runs = []
    devices = ["cpu"] + (["cuda"] if "cuda" in backends else [])
    for dev in devices:
        runs += [("pytorch", "torch", dev, model), ("fakequant", "torch", dev, fq)]
    for backend in backends:
        approx = convert_model(folded, multiplier, qcfg, stats, backend=backend)
        runs.append(("approx", backend, "cuda" if backend == "cuda" else "cpu", approx))
    rows = []
    for path, backend, dev, m in runs:
        reps, warm = (python_repeats, 0) if backend == "python" else (repeats, warmup)
        timed = run_timed(m, x, batch_size, torch.device(dev), warmup=warm, repeats=reps)
        rows.append(dict(path=path, backend=backend, device=dev, images=len(x), batch_size=batch_size,
                         threads=torch.get_num_threads(), repeats=reps,
                         min_ms=min(timed.pass_ms), median_ms=timed.total_ms_median,
                         mean_ms=statistics.fmean(timed.pass_ms),
                         images_per_s=len(x) / (timed.total_ms_median / 1e3)))
    df = pd.DataFrame(rows)
    for dev in devices:
        ref = df.loc[(df.path == "pytorch") & (df.device == dev), "median_ms"].iloc[0]
        df.loc[df.device == dev, "x_pytorch_time"] = df.loc[df.device == dev, "median_ms"] / ref
    return df


def bench_train(model, multiplier, qcfg, data, backends, *, batch_size, repeats, warmup, epochs=1,
                grads=("ste", "lut"), lr=1e-4, seed=0, cuda_graph=(False, True)) -> pd.DataFrame:
    """Training cost per path, like a forward/backward table: one step (forward + backward + Adam) on a fixed
    batch, median of `repeats` after `warmup`, and whole epochs over the training set (median of `epochs`
    after one untimed epoch) for pytorch fp32, fake-quant (QAT) and approx (each backend, each gradient).
    Every step is runner.train_step's, the one finetune runs: on a GPU once eager and once as a CUDA graph
    (cuda_graph: which of the two), with `step_mode` saying what ran (a step that cannot be captured runs
    eagerly; `step_note` says why)."""
    import torch.nn.functional as F

    from runner.evaluate import Clock
    from runner.layers import convert_model, quantized_models, set_grad_mode
    from runner.models import fold_input_normalization
    from runner.train_step import GRAPH_WARMUP, TrainStep

    fq, _, stats = quantized_models(model, multiplier, qcfg, data.train_x, backend="python", seed=seed)
    folded = fold_input_normalization(model)
    devices = ["cpu"] + (["cuda"] if "cuda" in backends else [])
    runs = []
    for dev in devices:
        runs += [("pytorch", "torch", "", dev, model), ("fakequant", "torch", "ste", dev, fq)]
    for backend in backends:
        for grad in grads:
            approx = convert_model(folded, multiplier, qcfg, stats, backend=backend)
            set_grad_mode(approx, grad)
            runs.append(("approx", backend, grad, "cuda" if backend == "cuda" else "cpu", approx))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.train_x), generator=gen)[:batch_size]
    rows = []
    for (path, backend, grad, dev, base), graph in [(r, g) for r in runs for g in
                                                    (cuda_graph if r[3] == "cuda" else (False,))]:
        device = torch.device(dev)
        m = copy.deepcopy(base).to(device).train()

        def loss_of(x, y, m=m):
            logits = m(x)
            return F.cross_entropy(logits, y), logits, y

        step = TrainStep(m, loss_of, "adam", lr, 0.0, device, cuda_graph=graph)
        xb, yb = data.train_x[idx].to(device), data.train_y[idx].to(device)
        clock = Clock(device)
        for _ in range(max(int(warmup), GRAPH_WARMUP + 1 if graph else 0)):  # a graph is captured before timing
            step(xb, yb)
        step_ms = []
        for _ in range(repeats):
            t0 = clock.start()
            step(xb, yb)
            step_ms.append(clock.ms_since(t0))
        loader = data.loader("train", batch_size, shuffle=True, seed=seed)
        epoch_s = []
        for e in range(epochs + 1):  # the first epoch warms up (allocator, tables, auto's trials)
            t0 = time.perf_counter()
            for x, y in loader:
                step(x.to(device), y.to(device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if e:
                epoch_s.append(time.perf_counter() - t0)
        step.close()
        rows.append(dict(path=path, backend=backend, grad=grad, device=dev, cuda_graph=graph, step_mode=step.mode,
                         batch_size=batch_size, threads=torch.get_num_threads(), repeats=repeats,
                         images=len(data.train_x), step_ms_median=statistics.median(step_ms),
                         step_ms_min=min(step_ms), epoch_s_median=statistics.median(epoch_s),
                         step_note=step.reason if graph else ""))
    df = pd.DataFrame(rows)
    for (dev, graph), group in df.groupby(["device", "cuda_graph"]):
        ref = group.loc[group.path == "fakequant", "epoch_s_median"].iloc[0]
        df.loc[group.index, "x_fakequant_epoch"] = group["epoch_s_median"] / ref
    return df


# what the terminal tables show; the CSVs hold every column
_SHOWN = {
    "ops": ("backend", "algo", "layer", "batch", "dist", "threads", "median_us", "gmacs"),
    "algos": ("backend", "algo", "layer", "batch", "supported", "median_us", "gmacs", "workspace_mib", "auto_pick", "note"),
    "matmuls": ("backend", "model", "op", "codes", "batch", "B", "M", "N", "K", "threads", "median_us", "tmacs"),
    "model": ("path", "backend", "device", "images", "threads", "median_ms", "images_per_s", "x_pytorch_time"),
    "layers": ("backend", "layer", "kind", "kernel", "stride", "input_shape", "median_us", "gmacs", "fp32_gmacs",
               "x_fp32_time", "limit_fraction", "auto_pick"),
    "train": ("path", "backend", "grad", "device", "cuda_graph", "step_mode", "batch_size", "threads",
              "step_ms_median", "epoch_s_median", "x_fakequant_epoch"),
}


# Attention's two LUT matmuls per head (approx::lut_bmm): Q.K^T is [T, d] x [T, d]^T, P.V is [T, T] x ([d, T])^T.
# name: (heads, tokens, head dim). ViT-B/16 at 224x224 (the GPU bar's shape), and a small ViT of 32x32 images in
# 4x4 patches (64 patches + the class token).
ATTENTION_SHAPES = {"vit_b16": (12, 197, 64), "vit_small": (4, 65, 32)}


def attention_matmul_shapes(images, heads, tokens, head_dim):
    """{op: (B, M, N, K)} of lut_bmm for one attention layer over `images` images."""
    nb = images * heads
    return {"qk": (nb, tokens, tokens, head_dim), "av": (nb, tokens, head_dim, tokens)}


# Code distributions of attention's products: "uniform", every code equally likely (on the GPU the most
# shared-memory bank conflicts: the worst case); "attention", codes like real ones (concentrated: lanes reading the
# same table word are served at once); "narrow", more concentrated still (benchmarks/cuda_attention.py times it).
MATMUL_CODES = ("uniform", "attention")


def matmul_codes(op, shape, dist, gen, *, signed=True, device="cpu"):
    """lut_bmm's codes (a, b) of one attention product, op "qk" (a = Q, b = K) or "av" (a = P, b = V^T), of shape
    (B, M, N, K), drawn from `gen` on `device`. "uniform": Q, K, V uniform over int8, P uniform over its range;
    "attention": Q, K, V from a normal of std 32 codes, rounded and clamped to +-127, P a softmax over the tokens
    of normal logits x 2, scaled so its largest entry is the top code; "narrow": std 8 codes, logits x 1. P's codes
    are 0..127 (int8) on a signed table (signed=True), 0..255 (uint8) on an unsigned one. bench_matmuls and
    benchmarks/cuda_attention.py both draw their codes here."""
    nb, m, n, k = shape
    kw = dict(generator=gen, device=device)
    if dist == "uniform":
        a = torch.randint(-128, 128, (nb, m, k), **kw).to(torch.int8)
        b = torch.randint(-128, 128, (nb, n, k), **kw).to(torch.int8)
        if op == "av":
            hi, dt = (128, torch.int8) if signed else (256, torch.uint8)
            a = torch.randint(0, hi, (nb, m, k), **kw).to(dt)
        return a, b
    if dist not in ("attention", "narrow"):
        raise ValueError(f"unknown code distribution '{dist}'; valid: uniform, attention, narrow")
    std = {"attention": 32.0, "narrow": 8.0}[dist]
    normal = lambda s: (torch.randn(s, **kw) * std).round_().clamp_(-127, 127).to(torch.int8)  # noqa: E731
    a, b = normal((nb, m, k)), normal((nb, n, k))
    if op == "av":
        p = torch.softmax(torch.randn((nb, m, k), **kw) * (2.0 if dist == "attention" else 1.0), dim=-1)
        qmax = 127 if signed else 255
        a = (p / p.amax() * qmax).round_().to(torch.int8 if signed else torch.uint8)
    return a, b


def bench_matmuls(backends, batches=(64,), repeats=20, warmup=3, *, python_max_macs=20_000_000, python_repeats=2,
                  seed=0) -> pd.DataFrame:
    """Time approx::lut_bmm on attention's shapes (ATTENTION_SHAPES) per backend with the exact signed table:
    signed codes for Q, K, V, probabilities as codes 0..127 (their range on a signed multiplier), drawn per
    MATMUL_CODES distribution (`codes`: uniform, attention; matmul_codes) from a CPU generator seeded with `seed`,
    so every backend times the same codes. One row per (backend, model, op, codes, images): min / median / mean
    microseconds, T MAC/s from the median."""
    lut = exact_lut(True)
    rows = []
    for backend in backends:
        device = torch.device("cuda" if backend == "cuda" else "cpu")
        timer = device_timer(device)
        lut_d = lut.to(device)
        for model, (heads, tokens, head_dim) in ATTENTION_SHAPES.items():
            for images in batches:
                for op, shape in attention_matmul_shapes(images, heads, tokens, head_dim).items():
                    nb, m, n, k = shape
                    macs = nb * m * n * k
                    reps, warm = repeats, warmup
                    if backend == "python":
                        if macs > python_max_macs:
                            continue
                        reps, warm = min(repeats, python_repeats), min(warmup, 1)
                    for codes in MATMUL_CODES:
                        gen = torch.Generator().manual_seed(seed)
                        a, b = (t.to(device) for t in matmul_codes(op, shape, codes, gen))
                        fn = lambda: ops.lut_bmm(a, b, lut_d, backend=backend)  # noqa: E731
                        t = _timed(timer, fn, warm, reps, macs)
                        rows.append(dict(
                            backend=backend, model=model, op=op, codes=codes, batch=images, heads=heads,
                            tokens=tokens, head_dim=head_dim, B=nb, M=m, N=n, K=k, device=str(device),
                            threads=torch.get_num_threads(), **t,
                            tmacs=macs / t["median_us"] / 1e6 if t["median_us"] > 0 else float("nan"),
                        ))
    return pd.DataFrame(rows)


def check_bench_config(b) -> None:
    if not list(b.batches):
        raise UserError("bench.batches is empty; give batch sizes, e.g. bench.batches=[1,256].")
    for i, batch in enumerate(b.batches):
        config_number(batch, f"bench.batches[{i}]", minimum=1)
    for key, low in (("repeats", 1), ("warmup", 0), ("model_images", 1), ("model_batch_size", 1),
                     ("train_batch_size", 1), ("train_epochs", 1), ("python_max_macs", 0)):
        if key in b:
            config_number(b[key], f"bench.{key}", minimum=low)
    config_number(b.get("threads"), "bench.threads", minimum=1, optional=True)
    if b.get("matmuls", False):
        if not list(b.matmul_batches):
            raise UserError("bench.matmul_batches is empty; give images per call, e.g. bench.matmul_batches=[64].")
        for i, batch in enumerate(b.matmul_batches):
            config_number(batch, f"bench.matmul_batches[{i}]", minimum=1)


def run(cfg, out_dir):
    """`approx-run bench`: op-level, variant-level (--algos) and model-level timing; CSVs in the run dir."""
    from runner._ext import backend_status
    from runner.console import console, print_table
    from runner.multipliers import resolve
    from runner.provenance import atomic_write_json, environment
    from runner.quant import QuantConfig
    from runner.store import write_csv
    from runner.train import load_or_train

    b = cfg.bench
    check_bench_config(b)
    status = backend_status()
    unknown = [x for x in b.backends if x not in status]
    if unknown:
        raise UserError(f"bench.backends has unknown backend(s) {unknown}; choose from {list(status)}.")
    backends = [x for x in b.backends if status[x] == "available"]
    if not backends:
        why = "; ".join(f"{x}: {status[x]}" for x in b.backends) or "the list is empty"
        raise UserError(f"none of bench.backends={list(b.backends)} can run here ({why}). Available: "
                        f"{[x for x in status if status[x] == 'available']}.")
    for x in b.backends:
        if status[x] != "available":
            console.print(f"[yellow]skipping backend {x}[/]: {status[x]}")
    if b.threads:
        torch.set_num_threads(int(b.threads))
    tables = {}
    if b.ops:
        tables["ops"] = bench_ops(backends, batches=tuple(b.batches), repeats=int(b.repeats),
                                  warmup=int(b.warmup), python_max_macs=int(b.python_max_macs))
    if b.algos:
        tables["algos"] = bench_algos([x for x in backends if x != "python"], batches=tuple(int(x) for x in b.batches),
                                      repeats=int(b.repeats), warmup=int(b.warmup))
    if b.get("matmuls", False):
        tables["matmuls"] = bench_matmuls(backends, batches=tuple(int(x) for x in b.matmul_batches),
                                          repeats=int(b.repeats), warmup=int(b.warmup),
                                          python_max_macs=int(b.python_max_macs))
    if b.model:
        model, _, _, data = load_or_train(cfg)
        # a lazily read set (data=imagefolder) gives its first images as a tensor: the timed batches stay in memory
        test_x = data.test_x if isinstance(data.test_x, torch.Tensor) else data.test_x[: int(b.model_images)].to()
        reps = -(-int(b.model_images) // len(test_x))
        x = test_x.repeat(reps, 1, 1, 1)[: int(b.model_images)]
        mult = resolve(cfg.multiplier)
        tables["model"] = bench_models(model, mult, QuantConfig.from_cfg(cfg.quant), data.train_x, x,
                                       [x for x in backends if x != "python" or b.python_model],
                                       batch_size=int(b.model_batch_size), repeats=int(b.repeats),
                                       warmup=int(b.warmup))
    if b.get("layers", False):
        from runner.bench_layers import bench_model_layers

        model, _, _, data = load_or_train(cfg)
        tables["layers"] = bench_model_layers(model, resolve(cfg.multiplier), QuantConfig.from_cfg(cfg.quant),
                                              data.train_x, data.test_x, [x for x in backends if x != "python"],
                                              batches=tuple(b.layers_batches), repeats=int(b.repeats),
                                              warmup=int(b.warmup))
    if b.get("train", False):
        model, _, _, data = load_or_train(cfg)
        tables["train"] = bench_train(model, resolve(cfg.multiplier), QuantConfig.from_cfg(cfg.quant), data,
                                      [x for x in backends if x != "python" or b.python_train],
                                      batch_size=int(b.train_batch_size), repeats=int(b.repeats),
                                      warmup=int(b.warmup), epochs=int(b.train_epochs), grads=tuple(b.train_grads),
                                      seed=int(cfg.seed))
    for name, df in tables.items():
        if df.empty:  # e.g. only the python backend, on layers past python_max_macs
            console.print(f"[yellow]bench {name}[/]: nothing to time with these settings")
            continue
        write_csv(out_dir / f"{name}.csv", df)
        show = df if name not in ("ops", "layers", "matmuls") else df[df.batch == max(df.batch)]
        show = show[[c for c in _SHOWN[name] if c in show.columns]]
        print_table(show, f"approx-run bench: {name} (all columns: {out_dir / (name + '.csv')})")
    device = torch.device("cuda" if "cuda" in backends else "cpu")
    atomic_write_json(out_dir / "run.json", {**environment(device), "seed": int(cfg.seed),
                                             "bench": dict(b), "tables": list(tables)})
    return {name: len(df) for name, df in tables.items()}
