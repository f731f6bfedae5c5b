"""Max-pooling for converted models' inference on the CPU (runner.layers.convert_model installs it)."""
from __future__ import annotations

import torch
from torch import nn


class PairMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d that, for inference over 2x2 windows at stride 2 (LeNet-5's pools), takes two elementwise maxima
    of strided views: the same values (NaN included; a zero's sign may differ, which no quantize or sum reads)
    without max_pool2d's argmax indices, which its CPU kernel computes even when nothing asks for them (it was
    a fifth of an approx LeNet-5 pass: benchmarks/README.md). A forward that records gradients, and any other
    geometry, runs max_pool2d: its gradient goes to one maximum per window. convert_model gives converted
    models this class."""

    def forward(self, x):
        h, w = x.shape[-2:] if x.dim() in (3, 4) else (0, 0)
        # on a GPU max_pool2d is one pass already (its indices cost the CPU kernel), and this was not measured there
        if x.is_cuda or (torch.is_grad_enabled() and x.requires_grad) or h < 2 or w < 2 or not self._pairs():
            return super().forward(x)
        x = x[..., :h // 2 * 2, :w // 2 * 2]  # floor mode: an odd last row or column is in no window
        rows = torch.maximum(x[..., 0::2, :], x[..., 1::2, :])
        return torch.maximum(rows[..., 0::2], rows[..., 1::2])

    def _pairs(self) -> bool:
        def pair(v, value):
            return v in (value, (value, value), [value, value])
        return (pair(self.kernel_size, 2) and pair(self.stride, 2) and pair(self.padding, 0)
                and pair(self.dilation, 1) and not self.ceil_mode and not self.return_indices)


def pair_pools(model: nn.Module) -> None:
    """Every plain nn.MaxPool2d of the (copied) model becomes a PairMaxPool2d, in place: the same module object
    and its settings and hooks, so fx tracing (runner.linking) and the model's forward see the same steps."""
    for m in model.modules():
        if type(m) is nn.MaxPool2d:
            m.__class__ = PairMaxPool2d
