"""One training step of LeNet-5 (forward, loss, backward, optimizer) per path, batch, optimizer and mode.

Paths: fp32, fake-quant (QAT), approx with grad=ste and grad=lut (the LUT layers that `approx-run finetune`
trains, learned activation scales on as in its default). Modes: `plain` is the loop anyone writes (torch's
default optimizer, zero_grad / forward / backward / step); `eager` and `graph` are runner.train_step's step,
the one `approx-run finetune` and `bench` run (fused optimizer, learning rate in a device tensor, weight
requantization in the step), run eagerly or replayed as a CUDA graph (`step_mode` says what ran: a step that
cannot be captured runs eagerly). Each step is timed alone (CUDA events on the GPU, perf_counter on the CPU;
the host waits for the device after each step) after --warmup untimed steps: median and min of --repeats.
`per_step_ms` is the mean of --repeats steps run back to back (one wait at the end), the rate a training
loop without host waits reaches. x_fp32: step_ms_median over fp32's in plain mode at the same batch and
optimizer. The input batch is fixed and random, the model untrained: timing only.

    python benchmarks/train_step.py                                     # CPU, backend cpp
    python benchmarks/train_step.py --device cuda --backend cuda        # GPU: every path, plain/eager/graph
    python benchmarks/train_step.py --profile approx-ste --batches 32   # torch.profiler table of one path

Prints a table and (--csv FILE) writes it."""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.layers import learn_act_scales, quantized_models, set_grad_mode  # noqa: E402
from runner.models import LeNet5  # noqa: E402
from runner.multipliers import resolve  # noqa: E402
from runner.quant import QuantConfig  # noqa: E402

from runner.train_step import GRAPH_WARMUP, TrainStep  # noqa: E402

PATHS = ("fp32", "fakequant", "approx-ste", "approx-lut")
MODES = ("plain", "eager", "graph")


def build(path: str, multiplier: str, backend: str, learn_scales: bool, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    fp32 = LeNet5(mean=0.1307, std=0.3081)
    if path == "fp32":
        return fp32
    calib = torch.rand(256, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    fq, approx, _ = quantized_models(fp32, resolve(multiplier), QuantConfig(), calib, backend=backend)
    model = fq if path == "fakequant" else approx
    if path.startswith("approx"):
        set_grad_mode(model, path.split("-")[1], 48)
    learn_act_scales(model, learn_scales)
    return model


def make_step(model, optimizer: str, lr: float = 1e-4, mode: str = "plain", device=torch.device("cpu")):
    """step(x, y) of `mode` (MODES); also returns the TrainStep (None in plain mode)."""
    if mode != "plain":
        def loss_of(x, y):
            logits = model(x)
            return F.cross_entropy(logits, y), logits, y

        runner_step = TrainStep(model, loss_of, optimizer, lr, 0.0, device, cuda_graph=mode == "graph")
        return runner_step, runner_step
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(params, lr=lr)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step, None


def time_step(step, x, y, device, warmup: int, repeats: int) -> dict:
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    for _ in range(warmup):
        step(x, y)
    sync()
    alone = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(x, y)
            end.record()
            end.synchronize()
            alone.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(x, y)
            alone.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(x, y)
    sync()
    back_to_back = (time.perf_counter() - t0) * 1e3 / repeats
    return {"step_ms_median": statistics.median(alone), "step_ms_min": min(alone), "per_step_ms": back_to_back}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None, help="approx backend (default: cuda on a GPU, else cpp)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--modes", default=None, help="plain,eager,graph (default: all on a GPU, plain on the CPU)")
    ap.add_argument("--multiplier", default="mul8u_T83")
    ap.add_argument("--learn-scales", default="true", choices=("true", "false"))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", default=None, metavar="PATH", help="print a torch.profiler table of this path")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backend = args.backend or ("cuda" if device.type == "cuda" else "cpp")
    gen = torch.Generator().manual_seed(1)
    modes = (args.modes or (",".join(MODES) if device.type == "cuda" else "plain")).split(",")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.rand(batch, 1, 28, 28, generator=gen).to(device)
        y = torch.randint(0, 10, (batch,), generator=gen).to(device)
        for optimizer in args.optimizers.split(","):
            for path in args.paths.split(","):
                for mode in modes:
                    rows.append(measure(path, mode, optimizer, x, y, device, backend, args))
    fp32 = {(r["batch"], r["optimizer"]): r["step_ms_median"] for r in rows
            if r["path"] == "fp32" and r["mode"] == "plain"}
    for r in rows:
        ref = fp32.get((r["batch"], r["optimizer"]))
        r["x_fp32"] = r["step_ms_median"] / ref if ref else float("nan")
    report(rows, args.csv)


def report(rows: list[dict], csv_path: str | None) -> None:
    """The rows as a fixed-width table on stdout and, with csv_path, as a CSV (floats to 4 decimals)."""
    cols = list(rows[0])
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>14.3f}" if isinstance(r[c], float) else f"{str(r[c]):>14}" for c in cols))
    if csv_path:
        import csv

        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows)


def measure(path, mode, optimizer, x, y, device, backend, args) -> dict:
    """One row: `path`'s step in `mode` with `optimizer` on the batch (x, y)."""
    model = copy.deepcopy(build(path, args.multiplier, backend, args.learn_scales == "true"))
    step, runner_step = make_step(model.to(device).train(), optimizer, mode=mode, device=device)
    warmup = max(args.warmup, GRAPH_WARMUP + 1 if mode == "graph" else 0)  # captured before timing
    if args.profile == path:
        profile(step, x, y, device, warmup)
    res = time_step(step, x, y, device, warmup, args.repeats)
    return {"impl": "approx-run", "path": path, "backend": backend if path.startswith("approx") else "torch",
            "device": str(device), "batch": len(x), "optimizer": optimizer, "mode": mode,
            "step_mode": runner_step.mode if runner_step else "eager", "threads": torch.get_num_threads(),
            "repeats": args.repeats, **res}


def profile(step, x, y, device, warmup: int, steps: int = 20) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(warmup):
        step(x, y)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    print(f"torch.profiler, {steps} steps:")
    events = prof.key_averages()
    if device.type == "cuda":
        try:  # the device column's name changed across torch versions
            print(events.table(sort_by="self_device_time_total", row_limit=30))
        except (AttributeError, KeyError, ValueError):
            print(events.table(sort_by="self_cuda_time_total", row_limit=30))
    print(events.table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
