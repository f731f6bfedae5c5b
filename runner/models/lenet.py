"""LeNet-5 as in the seed projects: conv 5x5 1->6, max-pool, conv 5x5 6->16, max-pool,
fc 256->120->84->10, ReLU (on 28x28 images; on 32x32 fc1 takes the classic 400 inputs). Input is raw
pixels in [0, 1]; the data set's normalisation is the model's first step (a fixed affine layer), so it
can be folded into conv1 for quantized paths."""
from __future__ import annotations

from torch import nn

from runner.models.common import Normalize


class LeNet5(nn.Module):
    def __init__(self, num_classes: int = 10, mean=0.0, std=1.0, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        self.normalize = Normalize(mean, std)
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()
        self.flatten = nn.Flatten(1)

    def stages(self) -> list[tuple[str, nn.Module]]:
        """(name, step) in forward order. Listed rather than hard-coded in forward so an evaluation can
        start at any layer from activations it kept (runner.session); built per call, so it follows
        layers that conversion replaced."""
        return [("normalize", self.normalize), ("conv1", self.conv1), ("", self.relu), ("", self.pool),
                ("conv2", self.conv2), ("", self.relu), ("", self.pool), ("", self.flatten),
                ("fc1", self.fc1), ("", self.relu), ("fc2", self.fc2), ("", self.relu), ("fc3", self.fc3)]

    def forward(self, x):
        for _, step in self.stages():
            x = step(x)
        return x


