"""The one definition of "8-bit inference through a multiplier LUT".

Weights: symmetric int8 codes in [-127, 127], scale per tensor or per output channel
    (s_w = max|w| / 127).
Activations (the input of each Conv2d/Linear): one scale per tensor, zero-point 0,
    signed multiplier   -> int8 codes in [-128, 127], s_a = amax|x| / 127
    unsigned multiplier -> uint8 codes in [0, 255],   s_a = max(x) / 255 (the input must be >= 0)
    amax calibrated statically (min-max or a percentile over training batches) or per batch.
Codes are exactly what torch.fake_quantize_per_{tensor,channel}_affine rounds to, so the
fake-quant path and the LUT path see identical integers. The LUT products are summed exactly in
int32. What follows the sum (quant.requant; docs/quantization.md):
    float    the layer output is acc * (s_a * s_w) + bias in fp32 (reference_dequantize), and the next
             layer quantizes it again;
    integer  acc plus an int32 bias (quantize_bias) is requantized to the next layer's codes with a
             fixed-point multiplier and a rounding shift (requant_multiplier, reference_requantize);
             a layer with no quantized consumer directly after it (the logits) dequantizes.
Every step is defined here once, in integer or single IEEE-rounded fp32 operations, and the kernels
(runner.ops) do the same operations in the same order, so python, cpp and cuda give the same bits.
Calibration runs the float model in float64 on the CPU, so scales do not depend on the device or
the batching of the calibration forward."""
from __future__ import annotations

import copy
import fnmatch
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from runner.errors import UserError

WEIGHT_QMAX = 127
# what a layer does after its integer MAC (module docstring)
REQUANT = ("float", "integer")
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True)
class QuantConfig:
    weight: str = "per_channel"        # per_channel | per_tensor
    activation: str = "minmax"         # minmax | percentile | dynamic
    percentile: float = 99.99          # used by activation=percentile
    calib_batches: int = 8             # training batches seen by static calibration
    calib_batch_size: int = 256
    requant: str = "integer"           # integer | float (REQUANT; docs/quantization.md says why integer)

    def __post_init__(self):
        if self.weight not in ("per_channel", "per_tensor"):
            raise UserError(f"quant.weight={self.weight!r}: choose per_channel or per_tensor.")
        if self.activation not in ("minmax", "percentile", "dynamic"):
            raise UserError(f"quant.activation={self.activation!r}: choose minmax, percentile or dynamic.")
        if not 50.0 < float(self.percentile) <= 100.0:
            raise UserError(f"quant.percentile={self.percentile}: must be in (50, 100].")
        if int(self.calib_batches) < 1 or int(self.calib_batch_size) < 1:
            raise UserError("quant.calib_batches and quant.calib_batch_size must be >= 1.")
        if self.requant not in REQUANT:
            raise UserError(f"quant.requant={self.requant!r}: choose {' or '.join(REQUANT)}.")

    @classmethod
    def from_cfg(cls, cfg) -> "QuantConfig":
        known = {f.name for f in fields(cls)}
        data = dict(cfg)
        unknown = set(data) - known - {"name"}
        if unknown:
            raise UserError(f"unknown quant setting(s) {sorted(unknown)}; known: {sorted(known)}.")
        return cls(**{k: v for k, v in data.items() if k in known})

    def as_dict(self) -> dict:
        return asdict(self)


def act_qrange(signed: bool) -> tuple[int, int]:
    return (-128, 127) if signed else (0, 255)


def true_divide(t: torch.Tensor, number: float) -> torch.Tensor:
    """t / number rounded once (IEEE) on every device. PyTorch's CUDA division by a Python number multiplies by
    the number's float reciprocal instead (one rounding more than the CPU's division), so the scales computed on
    a GPU would differ from the CPU's in the last bit; a divisor tensor on t's device keeps true division."""
    return t / torch.full((), number, dtype=t.dtype, device=t.device)


def act_scale_from_amax(amax: torch.Tensor, signed: bool) -> torch.Tensor:
    """float32 scalar tensor; a zero range gets scale 1 so codes are 0 rather than NaN."""
    qmax = act_qrange(signed)[1]
    amax = amax.detach().float().reshape(())
    return torch.where(amax > 0, true_divide(amax, qmax), torch.ones_like(amax))


def dynamic_amax(x: torch.Tensor, signed: bool) -> torch.Tensor:
    return x.detach().abs().amax() if signed else x.detach().amax().clamp_min(0)


def fake_quant_act(x: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    qmin, qmax = act_qrange(signed)
    zero = torch.zeros((), dtype=torch.int32, device=x.device)
    return torch.fake_quantize_per_tensor_affine(x, scale.to(x.device), zero, qmin, qmax)


def reference_quantize(x: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """Activation codes: by definition the integers torch.fake_quantize_per_tensor_affine rounds to
    (fq / scale is within an ulp of the code). The oracle of the fused approx::quantize kernels."""
    scale = scale.to(x.device)
    return torch.round(fake_quant_act(x, scale, signed) / scale).to(torch.int8 if signed else torch.uint8)


def quantize_act(x: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """int8/uint8 codes equal to fake_quant_act's integers; runner.ops.quantize computes the same
    codes in one pass with the fused kernels."""
    return reference_quantize(x, scale, signed)


def weight_clip(w: torch.Tensor, granularity: str, factor: float = 1.0) -> torch.Tensor:
    """float32 [out_channels]: the largest |w| the codes represent, factor * max|w| (factor 1: max|w|, no
    clipping). Retraining with factor < 1 clips the largest weights for larger codes (finetune.weight_scale_factor)."""
    w = w.detach().float()
    if granularity == "per_channel":
        amax = w.abs().reshape(w.shape[0], -1).amax(dim=1)
    else:
        amax = w.abs().amax().expand(w.shape[0])
    return amax if factor == 1.0 else amax * factor


def weight_scale(w: torch.Tensor, granularity: str, factor: float = 1.0) -> torch.Tensor:
    """float32 [out_channels], weight_clip / 127; per_tensor repeats the one scale so kernels see one layout."""
    amax = weight_clip(w, granularity, factor)
    return torch.where(amax > 0, true_divide(amax, WEIGHT_QMAX), torch.ones_like(amax)).contiguous()


def fake_quant_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros(w.shape[0], dtype=torch.int32, device=w.device)
    return torch.fake_quantize_per_channel_affine(w, scale.to(w.device), zero, 0, -WEIGHT_QMAX, WEIGHT_QMAX)


class _FakeQuantSTE(torch.autograd.Function):
    """torch's fake-quantize, forward and gradient, in plain tensor ops: x_q = clamp(nearbyint(x * (1/s)), qmin,
    qmax) * s, and the gradient passed where the code was inside [qmin, qmax]. torch's own per-channel op checks
    its zero points on the host (a wait per call, and no CUDA graph can hold it)."""

    @staticmethod
    def forward(ctx, x, scale, qmin, qmax):
        q = torch.round(x * scale.reciprocal())
        ctx.save_for_backward((q >= qmin) & (q <= qmax))
        return q.clamp(qmin, qmax) * scale

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside, None, None, None


class _FakeQuantLSQ(torch.autograd.Function):
    """torch._fake_quantize_learnable_per_tensor_affine (zero point 0, grad_factor 1) in plain tensor ops, the
    same arithmetic in the same order, so the same bits (tests/test_quant.py): torch's op reads the scale on the
    host every call.
    The scale's gradient (LSQ, Esser et al. 2020): d x_q / d s = (x_q - x) / s inside the range, the clamp
    bound outside."""

    @staticmethod
    def forward(ctx, x, scale, qmin, qmax):
        inv = scale.reciprocal()
        q = torch.round(x * inv)
        ctx.save_for_backward(x, scale, inv, q)
        ctx.qrange = (qmin, qmax)
        return q.clamp(qmin, qmax) * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale, inv, q = ctx.saved_tensors
        qmin, qmax = ctx.qrange
        inside = (q >= qmin) & (q <= qmax)
        # x_q - x rounded once, as torch's kernels compute it (contracted to a fused multiply-add): q * s and
        # the difference are exact in float64 for codes inside the range
        diff = (q.clamp(qmin, qmax).double() * scale.double() - x.double()).float()
        per_element = torch.where(inside, grad * diff * inv, grad * torch.where(q < qmin, float(qmin), float(qmax)))
        return grad * inside, per_element.sum().reshape(scale.shape), None, None


def fake_quant_weight_ste(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fake_quant_weight's values and gradient without its host wait (training)."""
    return _FakeQuantSTE.apply(w, scale.to(w.device).view((-1,) + (1,) * (w.dim() - 1)), -WEIGHT_QMAX, WEIGHT_QMAX)


def fake_quant_act_lsq(x: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """Fake-quant of an activation at a learned per-tensor scale (0-d or 1-element, requires grad): values and
    gradients of torch's learnable fake-quantize, without its host wait."""
    return _FakeQuantLSQ.apply(x, scale.reshape(()), *act_qrange(signed))


def quantize_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes round(w * (1/scale)) clamped to +-WEIGHT_QMAX: the codes fake_quant_weight's grid holds, in
    its arithmetic (one float reciprocal, one multiply, round half to even), written with plain tensor ops
    because torch.fake_quantize_per_channel_affine waits for the GPU, and a training step calls this once a
    layer."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    inv = 1.0 / scale.detach().float().view(shape).to(w.device)
    return torch.clamp(torch.round(w.detach().float() * inv), -WEIGHT_QMAX, WEIGHT_QMAX).to(torch.int8)


def reference_dequantize(acc, act_scale, weight_scale, bias, residual=None, relu=False):
    """fp32 float(acc) * (act_scale * weight_scale[n]) + bias[n], channel dim 1: three IEEE roundings (the int to
    float conversion, the products; the multiply and the add rounded separately, never fused). acc may be int64,
    or float holding exact integers (fake-quant's exact sums): its conversion rounds the same integer the same way.
    residual (float32, acc's shape) is then added, one more rounding, and relu applies torch.relu: a residual
    block's sum and ReLU, as its own forward computes them."""
    shape = (1, -1) + (1,) * (acc.dim() - 2)
    out = acc.to(torch.float32) * (act_scale * weight_scale).view(shape) + bias.view(shape)
    if residual is not None:
        out = out + residual
    return torch.relu(out) if relu else out


def quantize_bias(bias: torch.Tensor, act_scale: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """int32 [N]: round(bias / (s_a * s_w[n])) (half to even), clamped to int32, on bias's device. In float64:
    the product of two float32 values is exact and the quotient rounds once (IEEE), so every device gives
    the same integers."""
    acc_scale = act_scale.detach().double().reshape(()).to(bias.device) * weight_scale.detach().double()
    q = torch.round(bias.detach().double() / acc_scale)
    return q.clamp(INT32_MIN, INT32_MAX).to(torch.int32)


def dequantized_bias(bias_q: torch.Tensor, act_scale: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """fp32 fl(float(bias_q) * fl(s_a * s_w[n])): the int32 bias of a layer that dequantizes (requant=integer
    with no quantized consumer next), added after fl(float(acc) * fl(s_a * s_w)) like a float bias."""
    return bias_q.to(torch.float32) * (act_scale.detach().float().reshape(()) * weight_scale.detach().float())


# requant_multiplier's range: M0 in [2^30, 2^31), 1 <= shift <= 63, so (int64(acc) + bias) * M0 fits int64
REQUANT_MAX_SHIFT = 63


def requant_multiplier(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M0, shift), int32 [N] on the CPU, with real[n] = M0 * 2^-shift to 31 significant bits (gemmlowp's
    QuantizeMultiplier): M0 in [2^30, 2^31) and 1 <= shift <= 63. A real multiplier below 2^-33 gets M0 = 0,
    which is exact: |acc + bias| < 2^32, so every code rounds to 0. real must be in
    [0, 2^30); real = 0 gives M0 = 0."""
    real = real.detach().double().cpu()
    if bool((real < 0).any() | ~torch.isfinite(real).all() | (real >= 2.0 ** 30).any()):
        raise UserError(f"requantization multiplier {real.tolist()} is outside [0, 2^30): the scales of "
                        "consecutive layers are degenerate (a zero or non-finite activation range?).")
    mant, exp = torch.frexp(real)                       # real = mant * 2^exp, mant in [0.5, 1)
    m0 = torch.round(mant * 2.0 ** 31).to(torch.int64)  # in [2^30, 2^31]
    carry = m0 == 1 << 31
    m0, exp = torch.where(carry, m0 // 2, m0), exp.to(torch.int64) + carry
    shift = 31 - exp
    gone = (shift > REQUANT_MAX_SHIFT) | (m0 == 0)
    m0, shift = torch.where(gone, 0, m0), torch.where(gone, REQUANT_MAX_SHIFT, shift)
    return m0.to(torch.int32), shift.to(torch.int32)


def reference_requantize(acc, bias, multiplier, shift, out_scale, qmin: int, qmax: int):
    """fp32 code * out_scale, with code = clamp(round((acc + bias[n]) * M0[n] / 2^shift[n]), qmin, qmax),
    channel dim 1. All in int64: acc + bias (|.| < 2^32) times M0 (< 2^31) fits; the division rounds half up,
    computed as ((p >> (shift - 1)) + 1) >> 1, which never overflows. The code times the scale is one IEEE
    rounding, and the next layer's quantize at that same scale recovers the code exactly (|error| of the
    round trip < 255 * 2^-22 < 0.5), so the next layer reads these codes; ReLU and max-pool in between are
    monotone and act on them as on codes."""
    code = reference_requantize_codes(acc, bias, multiplier, shift, qmin, qmax)
    return code.to(torch.float32).mul_(out_scale.reshape(()))


def reference_requantize_codes(acc, bias, multiplier, shift, qmin: int, qmax: int) -> torch.Tensor:
    """reference_requantize's codes, int64 (the caller picks the dtype)."""
    shape = (1, -1) + (1,) * (acc.dim() - 2)
    shift = shift.to(torch.int64).clamp(1, REQUANT_MAX_SHIFT).view(shape)  # the kernels clamp alike
    # in place: fake-quant runs this on whole batches, and each int64 pass is a large tensor
    p = acc.to(torch.int64, copy=True)
    p.add_(bias.to(torch.int64).view(shape)).mul_(multiplier.to(torch.int64).view(shape))
    return p.bitwise_right_shift_(shift - 1).add_(1).bitwise_right_shift_(1).clamp_(qmin, qmax)


@dataclass
class ActStats:
    min: float
    amax_signed: float     # what a signed multiplier's scale comes from
    amax_unsigned: float   # what an unsigned multiplier's scale comes from
    other: "ActStats | None" = None  # an attention product's second operand (runner.attention.MatMul)


def quant_layers(model: nn.Module, all_matmuls: bool = False) -> dict[str, nn.Module]:
    """The layers a conversion quantizes: every Conv2d and Linear, and the attention products (MatMul) that
    model.approx_matmuls made layers (all of them with all_matmuls: calibration observes them either way, so
    one calibration serves both settings)."""
    from runner.attention.matmul import MatMul

    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))
            or (isinstance(m, MatMul) and (m.approx or all_matmuls))}


def select_layers(model: nn.Module, layers) -> list[str]:
    """The Conv2d/Linear layer names to convert: all when `layers` is None/"all"/empty, else those named. A name
    is a module path (layer1.0.conv1) or a glob over them ('layer3.*', '*.shortcut.*'); each glob's matches come
    in the model's order, and a layer named twice is converted once."""
    available = list(quant_layers(model))
    if not layers or layers == "all":
        return available
    if isinstance(layers, str):
        layers = [layers]
    chosen, unknown = [], []
    for pattern in map(str, layers):
        found = [pattern] if pattern in available else \
            [n for n in available if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(n, pattern)]
        if not found:
            unknown.append(pattern)
        chosen += [n for n in found if n not in chosen]
    if unknown:
        products = [n for n in quant_layers(model, all_matmuls=True) if n not in available]
        hint = (f" (the attention products {products[:2]}... are layers with model.approx_matmuls=true)"
                if products and any(fnmatch.fnmatchcase(p, u) or p == u for u in unknown for p in products) else "")
        raise UserError(f"layer(s) {unknown} are not Conv2d/Linear layers of the model (nor globs matching one)"
                        f"{hint}; choose from {available}.")
    return chosen


def _stats(chunks: list[torch.Tensor], keep_all: bool, percentile: float, gen) -> ActStats:
    v = torch.cat(chunks)
    if keep_all:
        q = percentile / 100.0
        sample = v if v.numel() <= 1 << 24 else v[torch.randperm(v.numel(), generator=gen)[: 1 << 24]]
        amax_s = torch.quantile(sample.abs(), q).item()
        amax_u = max(torch.quantile(sample, q).item(), 0.0)
    else:
        amax_s, amax_u = v.abs().max().item(), max(v.max().item(), 0.0)
    return ActStats(min=v.min().item(), amax_signed=_f32(amax_s), amax_unsigned=_f32(amax_u))


def _never_called(model: nn.Module, names: list[str]) -> UserError:
    return UserError(
        f"calibration never saw the input of layer(s) {names}: the model's forward does not call them as modules "
        f"(their weight is read some other way, or they are unused for these inputs). Call each as a module "
        f"(self.fc(x) rather than F.linear(x, self.fc.weight)); runner.attention.explicit_attention(model, "
        f"example) rewrites nn.MultiheadAttention and torchvision's Swin attention and routes plain "
        f"F.linear/F.conv2d reads of a layer's weight through the layer. Or leave them out of "
        f"model.approx_layers (their multiplies then stay fp32).")


@torch.no_grad()
def calibrate(model: nn.Module, x: torch.Tensor, qcfg: QuantConfig, device=None, seed: int = 0,
              layers: dict[str, nn.Module] | None = None) -> dict[str, ActStats]:
    """Observe the input of every Conv2d/Linear (or of `layers`) over `calib_batches` seeded random
    batches of x.

    device None (a float model): a float64 copy of the model runs on the CPU, whatever device evaluates
    later, so the statistics do not depend on the device, its kernels (TF32, cuDNN's algorithm) or how the
    images are batched: float64 sums differ across those by ~1e-16 relative, far below a float32 ulp, and the
    statistics become float32 once, as scales (act_scale_from_amax). A device (recalibrating a converted
    model, whose LUT layers take float32): the model itself runs there.

    Runs for dynamic quantization too: the sign check (an unsigned multiplier needs inputs >= 0)
    must happen before inference, whatever the scale policy."""
    gen = torch.Generator().manual_seed(seed)
    n = min(len(x), qcfg.calib_batches * qcfg.calib_batch_size)
    idx = torch.randperm(len(x), generator=gen)[:n]
    dtype = torch.float64 if device is None else None
    if device is None:
        names = set(quant_layers(model, all_matmuls=True) if layers is None else layers)
        model, device = copy.deepcopy(model).to(torch.float64), "cpu"
        layers = {name: m for name, m in model.named_modules() if name in names}
    layers = quant_layers(model, all_matmuls=True) if layers is None else layers
    keep_all = qcfg.activation == "percentile"
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    seen_other: dict[str, list[torch.Tensor]] = {}

    def keep(into, t):
        v = t.detach().flatten().double().cpu()
        # min-max needs only each batch's extremes (exact, in any order); a percentile needs every value
        if v.numel():
            into.append(v if keep_all else torch.stack([v.min(), v.max()]))

    def hook(name):
        def fn(_module, args):
            keep(seen[name], args[0])
            if len(args) > 1 and isinstance(args[1], torch.Tensor):  # MatMul's second operand
                keep(seen_other.setdefault(name, []), args[1])
        return fn

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        model.eval().to(device)
        for i in range(0, n, qcfg.calib_batch_size):
            model(x[idx[i:i + qcfg.calib_batch_size]].to(device=device, dtype=dtype))
    finally:
        for h in handles:
            h.remove()
    missing = [name for name, chunks in seen.items() if not chunks]
    if missing:
        raise _never_called(model, missing)
    stats = {}
    for name, chunks in seen.items():
        stats[name] = _stats(chunks, keep_all, qcfg.percentile, gen)
        if name in seen_other:
            stats[name].other = _stats(seen_other[name], keep_all, qcfg.percentile, gen)
    return stats


def _f32(v: float) -> float:
    """The float32 nearest v, as a Python float: what the scale is computed from."""
    return torch.tensor(v, dtype=torch.float64).float().item()
