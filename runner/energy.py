"""Multiplier energy of one inference, relative to the exact 8-bit multiplier everywhere.

Per layer: multiplies per image (MACs) x the power of the layer's multiplier circuit. Power figures
are EvoApproxLib's published `pwr` (mW, 45 nm synthesis, the same clock for every circuit, so power is
proportional to energy per multiply), a figure the user gives (`power_mw` on `lut import` or in the
multiplier config), or, for a table identical to a shipped one (the generated `exact`), that table's
figure. The reference is the exact signed 8x8 multiplier mul8s_1KV6 (0.425 mW) in every layer, so
mult_energy_rel = 1.0 means exact everywhere. Layers that are not approximated count as that exact
multiplier. Counted: the multiplies only; not the adders of the accumulation, the memory traffic, the
activation functions, nor the energy of fp32 layers."""
from __future__ import annotations

import math

import torch
from torch import nn

from runner.quant import quant_layers

REFERENCE = "mul8s_1KV6"


@torch.no_grad()
def layer_macs(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, int]:
    """{Conv2d/Linear layer, attention product: multiplies per image}, from one forward pass of a zero image."""
    layers = quant_layers(model)
    macs: dict[str, int] = {}

    def hook(name):
        def fn(module, args, out):
            if isinstance(module, nn.Conv2d):
                per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
            elif len(args) > 1:  # an attention product a @ b^T (runner.attention.MatMul): heads * T * T * d
                per_output = args[0].shape[-1]
            else:
                per_output = module.in_features
            macs[name] = int(out.numel()) * per_output  # one image: whatever dim the batch is (sequence-first attention)
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    device = next(model.parameters()).device  # a model an evaluation left on the GPU stays there
    try:
        model(torch.zeros(1, *input_shape, device=device))
    finally:
        for h in handles:
            h.remove()
    return macs


def power_mw(m) -> float | None:
    """The multiplier's power in mW: its own figure, else that of an identical shipped table, else None."""
    from runner.multipliers.registry import shipped_entries

    fig = (m.published or {}).get("pwr")
    if fig not in (None, ""):
        return float(fig)
    for entry in shipped_entries().values():
        if entry["sha256"] == m.sha256:
            return float(entry["published"]["pwr"])
    return None


def reference_power_mw() -> float:
    from runner.multipliers import get

    return power_mw(get(REFERENCE))


def energy(multipliers: dict, approx_layers: list[str], macs: dict[str, int]) -> dict:
    """mult_energy_rel of the whole model and each layer's share ({} entries None without a figure)."""
    ref = reference_power_mw()
    total = sum(macs.values()) * ref
    per_layer, missing = {}, []
    for name, n in macs.items():
        p = power_mw(multipliers[name]) if name in approx_layers else ref
        if p is None:
            missing.append(name)
        per_layer[name] = {"macs": n, "power_mw": p, "energy_rel": None if p is None else n * p / total}
    rel = None if missing else sum(v["energy_rel"] for v in per_layer.values())
    return {"mult_energy_rel": rel, "layers": per_layer, "reference": REFERENCE, "reference_power_mw": ref}
