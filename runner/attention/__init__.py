"""Transformers for conversion: every multiply of an attention seen as a layer.

explicit_attention rewrites the modules whose multiplies a conversion cannot see into explicit equivalents
(nn.MultiheadAttention -> runner.attention.mha.Attention; torchvision's Swin window attention -> its explicit twin,
runner.attention.swin), each with its projections called as Linear modules and its products Q.K^T and P.V as
MatMul modules `qk` and `av`; and routes the remaining functional reads of a layer's weight
(F.linear(x, self.fc.weight)) through the layer (runner.attention.routing). use_matmuls makes the products layers
(model.approx_matmuls): quant_layers then lists them, and conversion quantizes both their operands
(runner.attention.quantized)."""
from __future__ import annotations

import torch
from torch import nn

from runner.attention.matmul import MatMul
from runner.attention.mha import Attention
from runner.attention.routing import functional_reads, route_weights
from runner.attention.swin import ExplicitSwin, explicit_swin, swin_classes

__all__ = ["Attention", "MatMul", "explicit_attention", "use_matmuls", "matmul_layers"]


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def explicit_attention(model: nn.Module, example: torch.Tensor | None = None) -> nn.Module:
    """The model (changed in place) with its attention modules explicit, and, given an example input whose
    forward shows a functional read of a layer's weight, that read routed through the layer. Leaves the fp32
    outputs unchanged up to float rounding (tests/attention)."""
    swin = swin_classes()
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.MultiheadAttention):
            _set_module(model, name, Attention(m, name).to(next(m.parameters()).device))
        elif swin and isinstance(m, swin) and not isinstance(m, ExplicitSwin):
            explicit_swin(m)
    if example is not None and functional_reads(model, example):
        route_weights(model)
    return model


def use_matmuls(model: nn.Module, on: bool) -> nn.Module:
    """Make every attention product a layer (on) or float (off), in place; returns the model."""
    for m in model.modules():
        if isinstance(m, MatMul):
            m.approx = bool(on)
    return model


def matmul_layers(model: nn.Module) -> dict[str, MatMul]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MatMul)}
