"""A small MobileNetV2 (Sandler et al. 2018) for 28x28 and 32x32 images: a 3x3 stem at stride 1 (CIFAR-style),
inverted residual blocks (1x1 expand conv, 3x3 depthwise conv, 1x1 linear project conv, each with BatchNorm;
ReLU6 after expand and depthwise; a residual add when stride 1 keeps the width), a 1x1 head conv, global
average pooling and one Linear."""
from __future__ import annotations

from torch import nn

from runner.models.common import GlobalAvgPool, Normalize

# (expansion t, output channels c, blocks n, stride of the first s), as in the paper's table 2, shortened
SMALL = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 2, 2))


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1, relu6: bool = True):
    layers = [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out)]
    return nn.Sequential(*layers, nn.ReLU6()) if relu6 else nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expansion: int):
        super().__init__()
        hidden = c_in * expansion
        self.expand = _conv_bn(c_in, hidden, 1) if expansion != 1 else nn.Identity()
        self.depthwise = _conv_bn(hidden, hidden, 3, stride, groups=hidden)
        self.project = _conv_bn(hidden, c_out, 1, relu6=False)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.residual else out  # the add runs in float (see docs/models.md)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, mean=0.0, std=1.0,
                 stem: int = 16, head: int = 128, blocks=SMALL):
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        self.normalize = Normalize(mean, std)
        self.stem = _conv_bn(in_channels, stem, 3)
        layers, c = [], stem
        for t, width, n, s in blocks:
            for i in range(n):
                layers.append(InvertedResidual(c, width, s if i == 0 else 1, t))
                c = width
        self.blocks = nn.Sequential(*layers)
        self.head = _conv_bn(c, head, 1)
        self.pool = GlobalAvgPool()
        self.fc = nn.Linear(head, num_classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(self.normalize(x))))
        return self.fc(self.pool(x).flatten(1))
