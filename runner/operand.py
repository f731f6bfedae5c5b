"""Operand-aware error metrics: a multiplier's error as a layer actually uses it.

A table's uniform metrics (MAE%, WCE%) weigh all 65,536 operand pairs alike, but a layer multiplies
mostly small activations (after ReLU) by small weights. Over the calibration images (the first
HIST_IMAGES) we count, per approximated layer, how often each (activation code, weight code) pair is
multiplied: the joint histogram H. With the table's error E = product - exact product, weighted by H:

    op_mean_error, op_error_std   mean and std of one product's error (product units)
    op_mae                        mean |error| of one product
    acc error rms                 sqrt(K std^2 + (K mean)^2): predicted error of one output accumulator
                                  summing K products (errors independent; the mean adds up)
    op_acc_nrmse                  that, relative to the rms of the exact accumulator over the same images

Columns of a results row aggregate the layers: op_mae_pct and op_error_std are weighted by each layer's
multiplies (op_mae_pct relative to 2^16 like MAE%), op_acc_nrmse = sqrt(sum over layers of its square)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runner.exact_conv import exact_conv2d
from runner.quant import QuantConfig, quantize_weight, reference_quantize

_SIZE = 256


# images the histograms are counted over: LeNet-5 multiplies 281,640 times per image, so 512 images give
# 144 M products, plenty for 65,536 bins; more would only slow every command that records a row
HIST_IMAGES = 512


def _calibration_batches(x: torch.Tensor, qcfg: QuantConfig, seed: int):
    """The first HIST_IMAGES images calibration saw (runner.quant.calibrate's seeded choice)."""
    gen = torch.Generator().manual_seed(seed)
    n = min(len(x), qcfg.calib_batches * qcfg.calib_batch_size, HIST_IMAGES)
    idx = torch.randperm(len(x), generator=gen)[:n]
    return [x[idx[i:i + qcfg.calib_batch_size]] for i in range(0, n, qcfg.calib_batch_size)]


def _tap_counts(rows: torch.Tensor, kernel, stride, padding, dilation, pad_row: int) -> torch.Tensor:
    """int64 [C * kh * kw, 256]: how often each LUT row meets each kernel tap (the weight's (C, kh, kw) order) over
    every output position. rows: uint8 LUT row indices [N, C, H, W]; padding meets the taps as pad_row (code 0).
    Counted from strided slices of the 1-byte rows, never an unfolded [positions, taps] copy of wider integers:
    the counts do not depend on which position a tap met a row at."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    x = F.pad(rows, (pw, pw, ph, ph), value=pad_row)
    ho = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    taps = [x[:, :, i * dh:i * dh + (ho - 1) * sh + 1:sh, j * dw:j * dw + (wo - 1) * sw + 1:sw]
            for i in range(kh) for j in range(kw)]
    t = torch.stack(taps, dim=2)                       # [N, C, kh*kw, ho, wo]
    k = t.shape[1] * t.shape[2]
    bins = (torch.arange(k, dtype=torch.int32, device=t.device) * _SIZE).reshape(1, t.shape[1], t.shape[2], 1, 1)
    return torch.bincount((t.to(torch.int32) + bins).flatten(), minlength=k * _SIZE).view(k, _SIZE)


def _pairs(layer, x: torch.Tensor):
    """(per-tap counts of the activations' LUT rows int64 [K, 256], weight codes [N, K], the exact accumulators
    [M, N])."""
    codes = reference_quantize(x, layer.input_scale(x), layer.signed)
    offset = 128 if layer.signed else 0
    wq = quantize_weight(layer.weight, layer.weight_scale)
    w = wq.to(torch.int64).reshape(layer.weight.shape[0], -1)
    if hasattr(layer, "stride"):  # a convolution: the activation each kernel tap meets, per output position
        rows = (codes.to(torch.int16) + offset).to(torch.uint8)
        act = _tap_counts(rows, layer.weight.shape[2:], layer.stride, layer.padding, layer.dilation, offset)
        acc = exact_conv2d(codes, wq, layer.stride, layer.padding, layer.dilation, 1)  # [B, N, ho, wo]
        acc = acc.permute(0, 2, 3, 1).reshape(-1, acc.shape[1])  # one row per output position
        return act, w, acc
    a = codes.reshape(-1, codes.shape[-1]).float()
    acc = a @ w.float().t()  # codes and sums of their products stay below 2^24: exact in float32
    return _column_counts(a.to(torch.int64) + offset), w, acc


def _column_counts(rows: torch.Tensor) -> torch.Tensor:
    """int64 [K, 256]: how often each value 0..255 occurs in each column of rows [M, K]."""
    k = rows.shape[1]
    taps = (torch.arange(k, device=rows.device) * _SIZE).unsqueeze(0)
    return torch.bincount((rows + taps).flatten(), minlength=k * _SIZE).view(k, _SIZE)


def _exact_square_sum(acc: torch.Tensor) -> int:
    """sum(acc ** 2) of integer accumulators, exactly (a Python int): int64 sums of the squares' high and low
    halves, which no order of summation rounds, so every device gives the same number (a float64 sum of
    squares above 2^53 would round differently on a GPU than on the CPU)."""
    sq = acc.to(torch.int64).square()  # |acc| < 2^31: the square fits int64
    hi, lo = sq >> 31, sq & ((1 << 31) - 1)  # each below 2^31: 2^32 of them sum below 2^63
    return (int(hi.sum()) << 31) + int(lo.sum())


@torch.no_grad()
def operand_histograms(fq_model, layers: list[str], x: torch.Tensor, qcfg: QuantConfig, seed: int,
                       device: torch.device | None = None) -> dict:
    """{layer: {"hist": float64 [256 activation rows, 256 weight codes + 128], "k": products per output,
    "acc_ms": mean square of the exact accumulator}} over the calibration images, for the named fake-quant
    layers of fq_model (grouped convolutions are left out), computed on `device` (default: where the model is):
    counts and integer sums, so the same numbers on every device."""
    modules = {n: fq_model.get_submodule(n) for n in layers}
    modules = {n: m for n, m in modules.items() if getattr(m, "groups", 1) == 1}
    out = {n: {"hist": torch.zeros(_SIZE, _SIZE, dtype=torch.float64), "k": 0, "acc_ss": 0, "acc_n": 0}
           for n in modules}

    def hook(name):
        def fn(module, args):
            act, w, acc = _pairs(module, args[0])
            act = act.double().cpu()
            wts = _column_counts(w + 128).double().cpu()
            rec = out[name]
            rec["hist"] += act.t() @ wts
            rec["k"] = act.shape[0]
            rec["acc_ss"] += _exact_square_sum(acc)
            rec["acc_n"] += acc.numel()
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        fq_model.eval()
        if device is None:
            device = next(fq_model.parameters()).device  # where an earlier evaluation left it
        fq_model.to(device)
        for batch in _calibration_batches(x, qcfg, seed):
            fq_model(batch.to(device))
    finally:
        for h in handles:
            h.remove()
    return {n: {"hist": r["hist"], "k": r["k"], "acc_ms": r["acc_ss"] / max(1, r["acc_n"])} for n, r in out.items()}


_ERRORS: dict = {}


def _error_moments(m) -> torch.Tensor:
    """float64 [3, 65536]: the product error, its square and its magnitude, flattened in the histogram's
    layout (column = weight code + 128); kept per table, as every layer and evaluation reuses them."""
    from runner.lut_slopes import effective_products

    if (m.sha256, m.signed) not in _ERRORS:
        rows = torch.arange(_SIZE, dtype=torch.float64) - (128 if m.signed else 0)
        w = torch.arange(_SIZE, dtype=torch.float64) - 128
        err = (effective_products(m.lut, m.signed) - rows.unsqueeze(1) * w.unsqueeze(0)).flatten()
        _ERRORS[(m.sha256, m.signed)] = torch.stack([err, err * err, err.abs()])
    return _ERRORS[(m.sha256, m.signed)]


def layer_metrics(m, rec: dict) -> dict:
    if "p" not in rec:
        rec["p"] = (rec["hist"] / rec["hist"].sum().clamp_min(1)).flatten()
    mean, ms, mae = (_error_moments(m) @ rec["p"]).tolist()
    std = math.sqrt(max(0.0, ms - mean ** 2))
    k = rec["k"]
    acc_err = math.sqrt(k * std ** 2 + (k * mean) ** 2)
    return {"op_mean_error": mean, "op_error_std": std, "op_mae": mae, "op_acc_error_std": acc_err,
            "op_acc_nrmse": acc_err / math.sqrt(rec["acc_ms"]) if rec["acc_ms"] else None, "k": k}


def metrics(multipliers: dict, histograms: dict, macs: dict[str, int]) -> tuple[dict, dict]:
    """(row columns aggregated over the layers, {layer: its metrics})."""
    per_layer = {n: layer_metrics(multipliers[n], rec) for n, rec in histograms.items()}
    if not per_layer:
        return {}, {}
    weight = {n: macs.get(n, 0) for n in per_layer}
    total = sum(weight.values()) or 1
    nrmse = [v["op_acc_nrmse"] for v in per_layer.values()]
    cols = {"op_mae_pct": sum(weight[n] * v["op_mae"] for n, v in per_layer.items()) / total / 65536 * 100,
            "op_error_std": sum(weight[n] * v["op_error_std"] for n, v in per_layer.items()) / total,
            "op_acc_nrmse": None if None in nrmse else math.sqrt(sum(v ** 2 for v in nrmse))}
    return cols, per_layer
