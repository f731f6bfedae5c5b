"""LeNet-5 as in the seed projects: conv 5x5 1->6, max-pool, conv 5x5 6->16, max-pool,
fc 256->120->84->10, ReLU. Input is raw pixels in [0, 1]; the data set's normalisation is the
model's first step (a fixed affine layer), so it can be folded into conv1 for quantized paths."""
from __future__ import annotations

import copy

import torch
from torch import nn

from runner.errors import UserError


class Normalize(nn.Module):
    def __init__(self, mean: float, std: float):
        super().__init__()
        self.register_buffer("mean", torch.tensor(float(mean)))
        self.register_buffer("std", torch.tensor(float(std)))

    def forward(self, x):
        return (x - self.mean) / self.std


class LeNet5(nn.Module):
    def __init__(self, num_classes: int = 10, mean: float = 0.0, std: float = 1.0):
        super().__init__()
        self.normalize = Normalize(mean, std)
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
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


MODELS = {"lenet5": LeNet5}


def run_until(model: nn.Module, x: torch.Tensor, layer: str) -> torch.Tensor:
    """The input `layer` receives when the model runs on x."""
    for name, step in model.stages():
        if name == layer:
            return x
        x = step(x)
    raise ValueError(f"{layer!r} is not a stage of {type(model).__name__}")


def run_from(model: nn.Module, x: torch.Tensor, layer: str) -> torch.Tensor:
    """The model's output given the input of `layer` (what run_until returned). The model's forward hooks run
    on it as after a forward (a converted model's hook reports the non-finite inputs its layers saw)."""
    started, kept = False, x
    for name, step in model.stages():
        started = started or name == layer
        if started:
            x = step(x)
    for hook in list(model._forward_hooks.values()):
        x = hook(model, (kept,), x) or x
    return x


def build_model(cfg, mean: float, std: float) -> nn.Module:
    """cfg: the `model` config node."""
    if cfg.name not in MODELS:
        raise UserError(f"Unknown model '{cfg.name}'. Available: {', '.join(MODELS)}.")
    return MODELS[cfg.name](num_classes=int(cfg.get("num_classes", 10)), mean=mean, std=std)


def fold_input_normalization(model: nn.Module) -> nn.Module:
    """A copy of the model whose Normalize is folded into the following conv1, so conv1 sees raw
    pixels (>= 0, exactly representable as uint8 codes with scale 1/255).

    conv((x - m) / s) = conv'(x) with w' = w / s and b' = b - (m / s) * sum(w): exact because
    conv1 has no padding (a padded border would be 0 in x but -m/s after normalisation)."""
    folded = copy.deepcopy(model)
    norm, conv = folded.normalize, folded.conv1
    if tuple(conv.padding) != (0, 0):
        raise ValueError("normalisation folds exactly into conv1 only when conv1 has no padding")
    mean, std = norm.mean.item(), norm.std.item()
    with torch.no_grad():
        w = conv.weight / std
        b = conv.bias - (mean / std) * conv.weight.sum(dim=(1, 2, 3))
        conv.weight.copy_(w)
        conv.bias.copy_(b)
    folded.normalize = nn.Identity()
    return folded
