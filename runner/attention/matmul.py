"""The attention products as modules of their own: what makes them layers a conversion can name and replace."""
from __future__ import annotations

from torch import nn


class MatMul(nn.Module):
    """a @ b^T over the last two dims (both operands activations): an attention's Q.K^T (qk(q, k)) and P.V
    (av(p, v^T)). A float layer unless `approx` is set (model.approx_matmuls), when quant_layers lists it
    beside the Conv2d/Linear layers and conversion quantizes both operands."""

    def __init__(self, approx: bool = False):
        super().__init__()
        self.approx = bool(approx)

    def forward(self, a, b):
        return a @ b.transpose(-1, -2)

    def extra_repr(self):
        return f"approx={self.approx}"
