"""`approx-run bench` per layer of the chosen model (bench.layers): each Conv2d/Linear of the converted model
timed on its own input, as it runs inside the model (quantize, LUT MACs, requantize), beside the same layer in
PyTorch fp32 (BatchNorm folded in, as the quantized layer has it; cuDNN on the GPU). Finds the shapes where a kernel
is slow: 1x1 and depthwise convs, stride 2, 3-channel stems, large batches. The CPU backends are timed with the
wall clock, `cuda` with CUDA events (runner.bench.device_timer), both layers on the GPU."""
from __future__ import annotations

import copy
import functools
import math
import os
import statistics

import pandas as pd
import torch
from torch import nn


def layer_geometry(layer: nn.Module) -> dict:
    if isinstance(layer, nn.Conv2d):
        return {"kind": "depthwise" if layer.groups == layer.in_channels > 1 else "conv",
                "in_channels": layer.in_channels, "out_channels": layer.out_channels,
                "kernel": "x".join(map(str, layer.kernel_size)), "stride": layer.stride[0], "groups": layer.groups}
    return {"kind": "linear", "in_channels": layer.in_features, "out_channels": layer.out_features,
            "kernel": "", "stride": 1, "groups": 1}


# H100 SXM: 132 SMs x 32 shared-memory banks x 1.98 GHz boost, one 32-bit read per bank per clock; the
# CUDA kernels' pairs layout holds two 16-bit products per read, so products can reach twice this.
CUDA_READS_PER_S = {"H100": 132 * 32 * 1.98e9, "H200": 132 * 32 * 1.98e9}


def lookup_limit(device: torch.device | str) -> float:
    """Table reads per second that bound a LUT kernel on `device`. CPU: measured, a pure gather loop on
    torch's threads (approx::lookup_rate, the ISA the kernels run); CUDA: shared-memory bank reads of an
    H100 / H200 (nan on other GPUs)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in CUDA_READS_PER_S.items() if k in name), float("nan"))
    return _cpu_lookup_rate(torch.get_num_threads(), os.environ.get("APPROX_RUN_CPU_ISA", ""))


@functools.lru_cache(maxsize=None)
def _cpu_lookup_rate(threads: int, isa: str) -> float:  # noqa: ARG001 (both key the cache)
    from runner import _ext  # noqa: F401  (loads the ops)

    return float(torch.ops.approx.lookup_rate(torch.zeros(1)))


@torch.no_grad()
def layer_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """{Conv2d/Linear name: the input it receives when `model` runs on x}."""
    from runner.quant import quant_layers

    seen, handles = {}, []
    for name, m in quant_layers(model).items():
        handles.append(m.register_forward_pre_hook(lambda _m, args, name=name: seen.__setitem__(name, args[0])))
    try:
        model.eval()(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def _median_us(fn, repeats: int, warmup: int, device: torch.device) -> float:
    from runner.evaluate import device_timer

    timer = device_timer(device)
    for _ in range(warmup):
        timer(fn)
    return statistics.median(timer(fn) for _ in range(repeats))


@torch.no_grad()
def bench_model_layers(model: nn.Module, multiplier, qcfg, calib_x: torch.Tensor, x: torch.Tensor, backends,
                       *, batches=(1, 256), repeats: int = 5, warmup: int = 1) -> pd.DataFrame:
    """One row per (backend, layer, batch): MACs, median time of the LUT layer and of the fp32 layer on the
    backend's device, GMAC/s, the fraction of the device's lookup limit those MACs reach (limit_fraction:
    products per second over lookup_limit's reads per second), and the kernel variant `auto` ran
    (auto_pick)."""
    from runner.attention import explicit_attention
    from runner.layers import convert_model, quantized_layers
    from runner.models import fold_input_normalization
    from runner.quant import calibrate, quant_layers

    # as approximate does: a raw nn.MultiheadAttention (torchvision's ViT) reads out_proj's weight itself, so
    # calibration would never see that layer's input
    model = explicit_attention(copy.deepcopy(model).cpu().eval(), calib_x[:1].cpu())
    folded = fold_input_normalization(model, calib_x[:1])
    stats = calibrate(folded, calib_x, qcfg)
    rows = []
    for backend in backends:
        device = torch.device("cuda" if backend == "cuda" else "cpu")
        on_device = copy.deepcopy(folded).to(device)
        floats = quant_layers(on_device)
        approx = convert_model(folded, multiplier, qcfg, stats, backend=backend).to(device)
        limit = lookup_limit(device)
        for batch in batches:
            inputs = layer_inputs(on_device, x[:batch].to(device))
            for name, layer in quantized_layers(approx, weights_only=True).items():
                inp = inputs[name]
                out_numel = floats[name](inp).numel()
                per_output = math.prod(layer.weight.shape[1:])
                macs = out_numel * per_output
                reps, warm = (1, 0) if backend == "python" else (repeats, warmup)
                lut_us = _median_us(lambda: layer(inp), reps, warm, device)
                fp32_us = _median_us(lambda: floats[name](inp), repeats, warmup, device)
                rows.append({"backend": backend, "device": device.type, "layer": name, **layer_geometry(floats[name]),
                             "input_shape": "x".join(map(str, inp.shape)), "batch": len(inp), "macs": macs,
                             "threads": torch.get_num_threads(), "repeats": reps, "median_us": lut_us,
                             "gmacs": macs / lut_us / 1e3, "fp32_median_us": fp32_us,
                             "fp32_gmacs": macs / fp32_us / 1e3, "x_fp32_time": lut_us / fp32_us,
                             "lookup_limit_g_per_s": limit / 1e9, "limit_fraction": macs / lut_us * 1e6 / limit,
                             "auto_pick": layer.auto_pick()})
    return pd.DataFrame(rows)
