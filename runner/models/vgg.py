"""A small VGG for 28x28 and 32x32 images: three stages of two 3x3 convs (32, 64, 128 channels) with
BatchNorm and ReLU, each ending in a 2x2 max-pool, then Linear 128*s*s -> 256 -> classes (s = image side / 8)."""
from __future__ import annotations

from torch import nn

from runner.models.common import Normalize


class VGG(nn.Module):
    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, mean=0.0, std=1.0,
                 widths=(32, 64, 128), hidden: int = 256):
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        self.normalize = Normalize(mean, std)
        layers, c = [], in_channels
        for width in widths:
            for _ in range(2):
                layers += [nn.Conv2d(c, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
                c = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        side = image_size // 2 ** len(widths)
        self.classifier = nn.Sequential(nn.Flatten(1), nn.Linear(c * side * side, hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(self.features(self.normalize(x)))
