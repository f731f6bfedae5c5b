"""The one definition of "8-bit inference through a multiplier LUT".

Weights: symmetric int8 codes in [-127, 127], scale per tensor or per output channel
    (s_w = max|w| / 127).
Activations (the input of each Conv2d/Linear): one scale per tensor, zero-point 0,
    signed multiplier   -> int8 codes in [-128, 127], s_a = amax|x| / 127
    unsigned multiplier -> uint8 codes in [0, 255],   s_a = max(x) / 255 (the input must be >= 0)
    amax calibrated statically (min-max or a percentile over training batches) or per batch.
Codes are exactly what torch.fake_quantize_per_{tensor,channel}_affine rounds to, so the
fake-quant path and the LUT path see identical integers. The LUT products are summed exactly in
int32; the layer output is acc * (s_a * s_w) + bias in fp32."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from runner.errors import UserError

WEIGHT_QMAX = 127


@dataclass(frozen=True)
class QuantConfig:
    weight: str = "per_channel"        # per_channel | per_tensor
    activation: str = "minmax"         # minmax | percentile | dynamic
    percentile: float = 99.99          # used by activation=percentile
    calib_batches: int = 8             # training batches seen by static calibration
    calib_batch_size: int = 256

    def __post_init__(self):
        if self.weight not in ("per_channel", "per_tensor"):
            raise UserError(f"quant.weight={self.weight!r}: choose per_channel or per_tensor.")
        if self.activation not in ("minmax", "percentile", "dynamic"):
            raise UserError(f"quant.activation={self.activation!r}: choose minmax, percentile or dynamic.")
        if not 50.0 < float(self.percentile) <= 100.0:
            raise UserError(f"quant.percentile={self.percentile}: must be in (50, 100].")
        if int(self.calib_batches) < 1 or int(self.calib_batch_size) < 1:
            raise UserError("quant.calib_batches and quant.calib_batch_size must be >= 1.")

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


def act_scale_from_amax(amax: torch.Tensor, signed: bool) -> torch.Tensor:
    """float32 scalar tensor; a zero range gets scale 1 so codes are 0 rather than NaN."""
    qmax = act_qrange(signed)[1]
    amax = amax.detach().float().reshape(())
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


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


def weight_scale(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """float32 [out_channels]; per_tensor repeats the one scale so kernels see one layout."""
    w = w.detach().float()
    if granularity == "per_channel":
        amax = w.abs().reshape(w.shape[0], -1).amax(dim=1)
    else:
        amax = w.abs().amax().expand(w.shape[0])
    return torch.where(amax > 0, amax / WEIGHT_QMAX, torch.ones_like(amax)).contiguous()


def fake_quant_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros(w.shape[0], dtype=torch.int32, device=w.device)
    return torch.fake_quantize_per_channel_affine(w, scale.to(w.device), zero, 0, -WEIGHT_QMAX, WEIGHT_QMAX)


def quantize_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    shape = (-1,) + (1,) * (w.dim() - 1)
    return torch.round(fake_quant_weight(w, scale) / scale.view(shape).to(w.device)).to(torch.int8)


@dataclass
class ActStats:
    min: float
    amax_signed: float     # what a signed multiplier's scale comes from
    amax_unsigned: float   # what an unsigned multiplier's scale comes from


def quant_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}


@torch.no_grad()
def calibrate(model: nn.Module, x: torch.Tensor, qcfg: QuantConfig, device="cpu", seed: int = 0,
              layers: dict[str, nn.Module] | None = None) -> dict[str, ActStats]:
    """Observe the input of every Conv2d/Linear (or of `layers`) over `calib_batches` seeded random
    batches of x.

    Runs for dynamic quantization too: the sign check (an unsigned multiplier needs inputs >= 0)
    must happen before inference, whatever the scale policy."""
    gen = torch.Generator().manual_seed(seed)
    n = min(len(x), qcfg.calib_batches * qcfg.calib_batch_size)
    idx = torch.randperm(len(x), generator=gen)[:n]
    layers = quant_layers(model) if layers is None else layers
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}

    def hook(name):
        def fn(_module, args):
            seen[name].append(args[0].detach().flatten().float().cpu())
        return fn

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        model.eval().to(device)
        for i in range(0, n, qcfg.calib_batch_size):
            model(x[idx[i:i + qcfg.calib_batch_size]].to(device))
    finally:
        for h in handles:
            h.remove()
    stats = {}
    for name, chunks in seen.items():
        v = torch.cat(chunks)
        if qcfg.activation == "percentile":
            q = qcfg.percentile / 100.0
            sample = v if v.numel() <= 1 << 24 else v[torch.randperm(v.numel(), generator=gen)[: 1 << 24]]
            amax_s = torch.quantile(sample.abs(), q).item()
            amax_u = max(torch.quantile(sample, q).item(), 0.0)
        else:
            amax_s, amax_u = v.abs().max().item(), max(v.max().item(), 0.0)
        stats[name] = ActStats(min=v.min().item(), amax_signed=amax_s, amax_unsigned=amax_u)
    return stats
