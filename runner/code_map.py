"""Table-aware weight codes: which stored code makes a LUT layer's products nearest the exact ones.

An approximate table computes LUT[a][c] where the exact product is a * m. For a coarse table (mul8u_T83:
every product of two operands in 8..63 is 0 or 4,608) the code m = round(w / s) is often not the code whose
products come nearest a * m over the activations the layer sees. The weights are stored codes chosen
offline, so a layer may store another code c(m) for m at no cost in hardware: the multiplier, its table
and the arithmetic stay what they are. Per layer

    c(m) = argmin_c  sum_a p(a) (LUT[a][c] - a m)^2        over the codes the layer may store

with p(a) the layer's activation codes (its LUT rows) over calibration images: the code whose products
are nearest, in mean square, to the exact ones for the activations this layer multiplies. Signed tables
map -127..127 to -127..127; unsigned ones (weights as sign and magnitude) map magnitudes 0..127, 0 to 0.

Retraining keeps the map (runner.layers applies it whenever it requantizes the weights) and its
straight-through gradient is that of the code m: the map is a property of the table, fixed before training.
Measured on the Fashion-MNIST validation split in docs/finetune.md."""
from __future__ import annotations

import torch
from torch import nn

from runner.operand import operand_histograms
from runner.quant import WEIGHT_QMAX, QuantConfig


def identity_code_map() -> torch.Tensor:
    """int8 [256]: code m (at index m + 128) -> m."""
    return torch.arange(-128, 128, dtype=torch.int16).clamp(-WEIGHT_QMAX, WEIGHT_QMAX).to(torch.int8)


def table_code_map(lut: torch.Tensor, signed: bool, act_rows: torch.Tensor) -> torch.Tensor:
    """int8 [256] code map (index m + 128) for a table `lut` [256 rows, 256 columns] (row a + 128 / column
    w + 128 when signed, a / w otherwise) and the counts of the activation rows the layer uses, [256]."""
    lut = lut.detach().to(torch.float64).cpu()
    p = act_rows.detach().to(torch.float64).cpu()
    p = p / p.sum() if p.sum() > 0 else torch.full_like(p, 1 / p.numel())
    offset = 128 if signed else 0
    a = torch.arange(256, dtype=torch.float64) - offset                 # each row's activation code
    targets = torch.arange(-WEIGHT_QMAX if signed else 0, WEIGHT_QMAX + 1)  # the codes m to map
    products = lut[:, targets + offset]                                 # [rows, candidate codes c]
    m = targets.to(torch.float64)[:, None]
    # sum_a p (LUT[a][c] - a m)^2 = sum_a p LUT^2 - 2 m sum_a p a LUT + m^2 sum_a p a^2, for every (m, c)
    cost = (p[:, None] * products ** 2).sum(0)[None, :] - 2 * m * (p * a)[None, :] @ products \
        + m ** 2 * (p * a * a).sum()
    plain = cost.diagonal()  # c = m (targets and candidates are the same codes)
    # another code only where it is strictly nearer: where columns tie on the layer's activations (a table whose
    # products do not depend on the weight code there), the plain code stays
    better = cost.min(1).values < plain - 1e-9 * plain.abs() - 1e-12
    best = torch.where(better, targets[cost.argmin(1)], targets)
    cmap = identity_code_map().to(torch.int64)
    if signed:
        cmap[targets + 128] = best
    else:  # magnitudes: the sign is applied after the product, so -m stores -c(m)
        best[0] = 0
        cmap[targets + 128] = best
        cmap[128 - targets] = -best
    return cmap.to(torch.int8)


@torch.no_grad()
def fit_code_maps(model: nn.Module, x: torch.Tensor, qcfg: QuantConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every LUT layer of `model` gets the code map of its table for the activation codes it sees over the
    calibration images (runner.operand's histograms, the model's own forward at its present scales);
    grouped convolutions, which the histograms leave out, keep the identity. Returns {layer: map}."""
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "set_weight_code_map")}  # the LUT layers
    hists = operand_histograms(model, list(layers), x, qcfg, seed)
    maps = {}
    for name, layer in layers.items():
        if name in hists:
            maps[name] = table_code_map(layer.lut, layer.signed, hists[name]["hist"].sum(1))
            layer.set_weight_code_map(maps[name])
    return maps
