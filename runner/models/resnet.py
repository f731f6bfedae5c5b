"""CIFAR-style ResNets (He et al. 2016, section 4.2), as ALWANN and TFApprox evaluate them: a 3x3 stem conv,
three stages of n basic blocks with 16, 32 and 64 channels (the 2nd and 3rd start with stride 2, their
shortcut a 1x1 conv with BatchNorm), global average pooling and one Linear. Depth 6n + 2: ResNet-8 (n=1),
ResNet-20 (n=3). Works on any input size (28x28 ends at 7x7, 32x32 at 8x8)."""
from __future__ import annotations

from torch import nn

from runner.models.common import GlobalAvgPool, Normalize


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))  # the residual add runs in float (see docs/models.md)


class ResNet(nn.Module):
    def __init__(self, depth: int = 20, num_classes: int = 10, in_channels: int = 3, image_size: int = 32,
                 mean=0.0, std=1.0, widths=(16, 32, 64)):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"a CIFAR ResNet has depth 6n + 2 (8, 14, 20, 32, ...), not {depth}")
        n = (depth - 2) // 6
        self.input_shape = (in_channels, image_size, image_size)
        self.normalize = Normalize(mean, std)
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        planes = widths[0]
        for i, width in enumerate(widths):
            blocks = []
            for j in range(n):
                blocks.append(BasicBlock(planes, width, 2 if i > 0 and j == 0 else 1))
                planes = width
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.pool = GlobalAvgPool()
        self.fc = nn.Linear(planes, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(self.normalize(x))))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.pool(x).flatten(1))


def resnet8(**kwargs) -> ResNet:
    return ResNet(depth=8, **kwargs)


def resnet20(**kwargs) -> ResNet:
    return ResNet(depth=20, **kwargs)
