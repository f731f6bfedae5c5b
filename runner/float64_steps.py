"""The float steps between a converted model's quantized layers computed in float64 and rounded once to float32.

A quantized layer reads its input as codes, round(x / s): a one-ulp difference in x changes the code where x lies
on a rounding boundary, and every value after it. ReLU, max-pooling and integer requantization keep codes, so a
CNN's backends agree bit for bit; LayerNorm, softmax and GELU do not: their float32 CPU and CUDA kernels reduce in
other orders and use other exp / erf approximations, so their float32 results differ in the last bit on some
elements, and a converted transformer's cuda and cpp logits differed (docs/models.md, "cuda and cpp").

Computed in float64 from the same float32 input, the two devices' results differ by a few float64 ulps (2^-52
relative and less); rounded to float32, they agree unless the exact value lies within that distance of a float32
rounding midpoint, which happens for about one element in 2^28 (docs/models.md has the arithmetic and the
expected count). A global average pool summed in float64 is exact in any order (runner.models.GlobalAvgPool).

float64_steps swaps the classes in place (as runner.pooling.pair_pools does): the same module objects, settings,
parameters, state-dict keys and hooks; runner.layers.convert_model applies it to the fake-quant and the LUT model
alike, so the two stay bit for bit equal with the exact table, and the fp32 model keeps torch's float32 steps.
The explicit attention (runner.attention) calls its softmax as an nn.Softmax module for this swap."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from runner.models.common import GlobalAvgPool


class Float64LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with the statistics, the normalisation and the affine (float32 parameters, exact in float64) in
    float64, rounded once to the input's dtype."""

    def forward(self, x):
        weight = None if self.weight is None else self.weight.double()
        bias = None if self.bias is None else self.bias.double()
        return F.layer_norm(x.double(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class Float64Softmax(nn.Softmax):
    def forward(self, x):
        return F.softmax(x.double(), self.dim, _stacklevel=5).to(x.dtype)


class Float64GELU(nn.GELU):
    def forward(self, x):
        return F.gelu(x.double(), approximate=self.approximate).to(x.dtype)


class Float64GlobalAvgPool(nn.AdaptiveAvgPool2d):
    """nn.AdaptiveAvgPool2d(1) (torchvision's Swin and ResNets before their head) as the zoo's float64 mean."""

    forward = GlobalAvgPool.forward


def _global(pool: nn.AdaptiveAvgPool2d) -> bool:
    size = pool.output_size
    return all(s == 1 for s in (size if isinstance(size, (tuple, list)) else (size,)))


# the exact classes swapped (a subclass, torchvision's LayerNorm2d, has a forward of its own)
_SWAPS = {nn.LayerNorm: Float64LayerNorm, nn.Softmax: Float64Softmax, nn.GELU: Float64GELU}


def float64_steps(model: nn.Module) -> nn.Module:
    """Every nn.LayerNorm, nn.Softmax, nn.GELU and global nn.AdaptiveAvgPool2d of the (copied) model computes in
    float64 from now on, in place; returns the model."""
    for m in model.modules():
        new = _SWAPS.get(type(m))
        if new is None and type(m) is nn.AdaptiveAvgPool2d and _global(m):
            new = Float64GlobalAvgPool
        if new is not None:
            m.__class__ = new
    return model
