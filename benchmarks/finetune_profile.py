"""Where a retraining epoch goes: runner.finetune.train_epochs for one epoch over mnist5k's 4,000 training
images, timed (median of --repeats after one warm-up epoch; wall and process CPU time, which a machine
shared with other jobs inflates less) and then once under torch.profiler, whose
self-time table (top --rows ops) and a breakdown by kind of op are printed.

    python benchmarks/finetune_profile.py --multiplier mul8u_T83 --grad ste --threads 2
    PYTHONPATH=/tmp/before python benchmarks/finetune_profile.py ...   # the same for another checkout
    python benchmarks/finetune_profile.py --device cuda --cuda-graph true    # GPU: the step as a CUDA graph
    python benchmarks/finetune_profile.py --device cuda --cuda-graph false   # GPU: the eager step

On a GPU the profile also counts, per training step: the GPU's kernel time, the host's time, kernel launches
(cudaLaunchKernel and friends; a graph replay is one cudaGraphLaunch) and host waits (stream, event and
device synchronizations, blocking copies).

The model is LeNet-5 untrained (seed 0), calibrated on the training images: timing only. Runs on the
runner package found first on sys.path (this checkout unless PYTHONPATH says otherwise)."""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: a checkout there wins

import runner  # noqa: E402
from runner.data import load_mnist5k  # noqa: E402
from runner.finetune import FinetuneConfig, train_epochs  # noqa: E402
from runner.layers import quantized_models  # noqa: E402
from runner.models import LeNet5  # noqa: E402
from runner.multipliers import resolve  # noqa: E402
from runner.quant import QuantConfig  # noqa: E402

# self time of the profiled ops, by kind (first match of the op name; the rest is "other aten")
KINDS = (("LUT MAC / grad kernels", ("approx::lut", "approx::qlinear", "approx::qconv2d")),
         ("quantize / dequantize", ("approx::quantize", "approx::dequantize", "fake_quantize", "aten::round",
                                    "aten::clamp", "aten::reciprocal")),
         ("optimizer", ("Optimizer.", "aten::_foreach", "aten::addcdiv", "aten::addcmul", "aten::lerp",
                        "aten::sqrt")),
         ("conv / matmul (fp32 autograd)", ("aten::convolution", "aten::mkldnn", "aten::mm", "aten::addmm",
                                            "aten::_convolution", "aten::thnn", "aten::_slow_conv")),
         ("non-finite checks", ("aten::isfinite", "aten::all", "aten::any", "aten::logical_")),
         ("data: DataLoader / indexing", ("enumerate(DataLoader)", "aten::index", "aten::stack",
                                          "aten::randperm")),
         ("host syncs (.item)", ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")))


def kind_of(name: str) -> str:
    return next((k for k, prefixes in KINDS if name.startswith(prefixes)), "other aten / python")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--multiplier", default="mul8u_T83")
    ap.add_argument("--grad", default="ste")
    ap.add_argument("--path", default="approx", choices=("approx", "fakequant"),
                    help="fakequant: the same loop training the fake-quant (QAT) model, for the ratio")
    ap.add_argument("--distill-alpha", type=float, default=None, help="(checkouts that have distillation)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cuda-graph", default="true", choices=("true", "false"), help="on a GPU (finetune.cuda_graph)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"runner: {runner.__file__}, threads {torch.get_num_threads()}")
    data = load_mnist5k(seed=0)
    torch.manual_seed(0)
    teacher = LeNet5(mean=0.1307, std=0.3081)
    device = torch.device(args.device)
    backend = "cuda" if device.type == "cuda" else "cpp"
    fq, approx, _ = quantized_models(teacher, resolve(args.multiplier), QuantConfig(), data.train_x, backend=backend)
    extra = {} if args.distill_alpha is None else {"distill_alpha": args.distill_alpha}
    kwargs = {} if args.distill_alpha is None else {"teacher": teacher}
    fcfg = FinetuneConfig(epochs=1, grad=args.grad, batch_size=args.batch_size, **extra)

    def epoch():
        model = copy.deepcopy(approx if args.path == "approx" else fq)
        with contextlib.redirect_stdout(io.StringIO()):
            t0, c0 = time.perf_counter(), time.process_time()
            train_epochs(model, data, fcfg, QuantConfig(), device, 0, "profile", cuda_graph=args.cuda_graph == "true",
                         **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t0, time.process_time() - c0

    epoch()
    times = [epoch() for _ in range(args.repeats)]
    wall, cpu = [t for t, _ in times], [c for _, c in times]
    where = f"{device}" + (f", cuda_graph={args.cuda_graph}" if device.type == "cuda" else "")
    print(f"{args.path} epoch on {where} ({len(data.train_x)} images, batch {args.batch_size}, {args.multiplier}, "
          f"grad={args.grad}, distill_alpha={args.distill_alpha}): median {statistics.median(wall):.3f} s wall of "
          f"{[round(t, 3) for t in wall]}, {statistics.median(cpu):.3f} s CPU time of the process "
          f"(the figure to compare on a shared machine with --threads 1)")
    if args.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        wall, _ = epoch()
    events = prof.key_averages()
    if device.type == "cuda":
        gpu_summary(events, wall, -(-len(data.train_x) // args.batch_size))
    by_kind = defaultdict(float)
    for e in events:
        by_kind[kind_of(e.key)] += e.self_cpu_time_total / 1e6
    total = sum(by_kind.values())
    print(f"profiled epoch: {wall:.3f} s wall, {total:.3f} s self time in profiled ops "
          f"(the rest, {max(0.0, wall - total):.3f} s: Python between ops and the profiler's own cost)")
    for kind, s in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<34} {s:7.3f} s  {100 * s / wall:5.1f} %")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


# CUDA runtime / driver calls of the profile: kernel launches and the host waits
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
            "cudaLaunchCooperativeKernel")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cuStreamSynchronize",
         "cuCtxSynchronize", "cuEventSynchronize")


def gpu_summary(events, wall: float, steps: int) -> None:
    """Per training step: GPU kernel time, host time, launches and host waits, from the profiler's events."""
    def device_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

    kernel_us = sum(device_us(e) for e in events if str(getattr(e, "device_type", "")).endswith("CUDA"))
    counts = {name: e.count for e in events for name in (e.key,)}
    launches = sum(counts.get(k, 0) for k in LAUNCHES)
    graphs = sum(counts.get(k, 0) for k in GRAPH_LAUNCHES)
    syncs = {k: counts[k] for k in SYNCS if counts.get(k)}
    print(f"per step ({steps} steps): wall {1e3 * wall / steps:.3f} ms, GPU kernels {kernel_us / 1e3 / steps:.3f} ms "
          f"({100 * kernel_us / 1e6 / wall:.1f} % of the wall time), kernel launches {launches / steps:.1f}, "
          f"graph launches {graphs / steps:.2f}, host waits {sum(syncs.values()) / steps:.2f} {syncs}")


if __name__ == "__main__":
    main()
