"""What every model shares: the input normalisation layer, and the folds that turn a trained fp32 model into
the one whose Conv2d/Linear layers are quantized (BatchNorm into the conv before it, the data set's
normalisation into the first conv), as int8 deployment does."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Normalize(nn.Module):
    """(x - mean) / std, one value per channel or one for all (a scalar keeps LeNet-5's checkpoint as it was)."""

    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))

    def _shaped(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, 1, 1) if t.dim() == 1 else t

    def forward(self, x):
        return (x - self._shaped(self.mean)) / self._shaped(self.std)


class GlobalAvgPool(nn.Module):
    """The mean of each channel's map, [N, C, H, W] -> [N, C, 1, 1], summed in float64. A float32 sum depends
    on the order of its terms, which differs between the CPU and a GPU. float64 has 29 more mantissa bits than
    float32, so the sum of a map's float32 values is exact (in any order) unless some term is below 2^-29 of
    the largest, and the mean comes out the same on every device."""

    def forward(self, x):
        return x.double().mean(dim=(-2, -1), keepdim=True).to(x.dtype)


class PadWith(nn.Module):
    """Pads an image with one value per channel. After the normalisation is folded into a padded first conv,
    the border must be the raw pixel value that normalises to 0 (the channel mean), not 0."""

    def __init__(self, value: torch.Tensor, padding: tuple[int, int]):
        super().__init__()
        self.register_buffer("value", value.detach().float().reshape(-1).clone())
        self.padding = tuple(int(p) for p in padding)

    def forward(self, x):
        ph, pw = self.padding
        n, c, h, w = x.shape
        out = self.value.to(x.dtype).reshape(1, -1, 1, 1).expand(n, c, h + 2 * ph, w + 2 * pw).clone()
        out[:, :, ph:ph + h, pw:pw + w] = x  # copied, not x - m + m: the pixels stay bit for bit
        return out

    def extra_repr(self):
        return f"padding={self.padding}"


class _Flatten(nn.Module):
    """torch.flatten(x, 1) where a torchvision model's forward calls it before its classifier (a no-op on [N, C])."""

    def forward(self, x):
        return torch.flatten(x, 1)


def _chain(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """A Sequential's children as steps (its forward is exactly that chain), any other module as one step."""
    if type(module) is nn.Sequential:
        return [step for name, child in module.named_children() for step in _chain(child, f"{prefix}{name}.")]
    return [(prefix[:-1], module)]


def stages_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, step) in forward order: the model's own stages(), or, for a model without them (torchvision's), the
    guess that its forward is its input_norm, then its children in registration order (Sequentials expanded),
    with a flatten before the first Linear. The guess holds for ResNet, MobileNet, EfficientNet, ConvNeXt, VGG,
    RegNet ...; a caller must check it against the model's forward (chain_matches) before relying on it."""
    if hasattr(model, "stages"):
        return model.stages()
    steps = [("input_norm", model.input_norm)] if isinstance(getattr(model, "input_norm", None), nn.Module) else []
    flattened = False
    for name, child in model.named_children():
        if name == "input_norm":
            continue
        for step in _chain(child, f"{name}."):
            if not flattened and (isinstance(step[1], nn.Linear) or getattr(step[1], "linear_layer", False)):
                steps.append(("", _Flatten()))
                flattened = True
            steps.append(step)
    return steps


def _starts(name: str, layer: str) -> bool:
    """Whether the stage `name` is `layer` or holds it (torchvision's stages are blocks of several layers)."""
    return bool(name) and (name == layer or layer.startswith(name + "."))


def run_until(model: nn.Module, x: torch.Tensor, layer: str, after: str | None = None) -> torch.Tensor:
    """The input of the stage that holds `layer` when the model runs on x (a straight chain: stages_of); with
    `after`, x is the input of the stage holding that earlier layer (what run_until returned for it), and only
    the stages between run."""
    started = after is None
    for name, step in stages_of(model):
        started = started or _starts(name, after)
        if _starts(name, layer):
            if not started:
                raise ValueError(f"{after!r} does not come before {layer!r} in {type(model).__name__}'s stages")
            return x
        if started:
            x = step(x)
    raise ValueError(f"{layer!r} is not in a stage of {type(model).__name__}")


def stage_position(model: nn.Module, layer: str) -> int:
    """Index in stages_of(model) of the stage that holds `layer`."""
    for i, (name, _) in enumerate(stages_of(model)):
        if _starts(name, layer):
            return i
    raise ValueError(f"{layer!r} is not in a stage of {type(model).__name__}")


def run_from(model: nn.Module, x: torch.Tensor, layer: str) -> torch.Tensor:
    """The model's output given the input of the stage that holds `layer` (what run_until returned). The model's
    forward hooks run on it as after a forward (a converted model's hook reports the non-finite inputs its layers
    saw)."""
    started, kept = False, x
    for name, step in stages_of(model):
        started = started or _starts(name, layer)
        if started:
            x = step(x)
    for hook in list(model._forward_hooks.values()):
        x = hook(model, (kept,), x) or x
    return x


def chain_matches(model: nn.Module, x: torch.Tensor, layer: str) -> bool:
    """Whether running the stages up to `layer` and on from it gives the model's own output on x, bit for bit
    (a model whose forward is not the chain stages_of guessed: the answer is no, and it runs whole)."""
    try:
        with torch.no_grad():
            return torch.equal(run_from(model, run_until(model, x, layer), layer), model(x))
    except (ValueError, RuntimeError, TypeError):
        return False


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` at the dotted module path `name` of model."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@torch.no_grad()
def _trace(model: nn.Module, example: torch.Tensor):
    """Which module feeds which: ({BatchNorm name: the Conv2d whose output is its input},
    (Normalize name, the names of the modules that read its output)). Found by running the model once with
    hooks, so it holds for any forward, not only for Sequential containers."""
    producers: dict[int, tuple[str, torch.Tensor]] = {}  # id(output) -> (module, output kept alive)
    bn_of: dict[str, str] = {}
    norm: list = [None, []]
    handles = []

    def produced(name):
        def fn(_m, _args, out):
            if isinstance(out, torch.Tensor):
                producers[id(out)] = (name, out)
        return fn

    def consumed(name, module):
        def fn(_m, args):
            src = producers.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
            if src is None:
                return
            if src[0] == norm[0]:
                norm[1].append(name)
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                bn_of[name] = src[0]
        return fn

    leaves = {n: m for n, m in model.named_modules() if n and (not list(m.children()) or isinstance(m, Normalize))}
    for n, m in leaves.items():
        if isinstance(m, Normalize) and norm[0] is None:
            norm[0] = n
        if isinstance(m, (nn.Conv2d, Normalize)):
            handles.append(m.register_forward_hook(produced(n)))
        handles.append(m.register_forward_pre_hook(consumed(n, m)))
    was_training = model.training
    try:
        model.eval()(example)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    bn_of = {b: c for b, c in bn_of.items() if isinstance(model.get_submodule(c), nn.Conv2d)}
    return bn_of, (norm[0], norm[1])


@torch.no_grad()
def fold_batchnorm(conv: nn.Conv2d, bn: nn.modules.batchnorm._BatchNorm) -> None:
    """conv followed by bn (eval mode) as one conv: w' = w * g / sqrt(var + eps), b' = (b - mean) * g /
    sqrt(var + eps) + beta, per output channel."""
    gamma = bn.weight if bn.affine else torch.ones_like(bn.running_var)
    beta = bn.bias if bn.affine else torch.zeros_like(bn.running_var)
    scale = gamma / torch.sqrt(bn.running_var + bn.eps)
    bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
    conv.weight.copy_(conv.weight * scale.reshape(-1, 1, 1, 1))
    conv.bias = nn.Parameter((bias - bn.running_mean) * scale + beta)


@torch.no_grad()
def _fold_normalize(conv: nn.Conv2d, norm: Normalize) -> nn.Module:
    """Fold norm into conv (which reads only norm's output); returns what replaces norm (a per-channel pad
    when conv pads, else nothing).

    conv((x - m) / s) = conv'(x) with w' = w / s and b' = b - sum(w * m / s), where the zero border of the
    normalised image is the border m of the raw one."""
    mean, std = norm.mean, norm.std
    if conv.bias is None:
        conv.bias = nn.Parameter(torch.zeros(conv.out_channels))
    if mean.dim() == 0:  # one value for every channel: LeNet-5's arithmetic, as before
        b = conv.bias - (mean.item() / std.item()) * conv.weight.sum(dim=(1, 2, 3))
        conv.weight.copy_(conv.weight / std.item())
    else:
        shape = (1, -1, 1, 1)
        b = conv.bias - (conv.weight * (mean / std).reshape(shape)).sum(dim=(1, 2, 3))
        conv.weight.copy_(conv.weight / std.reshape(shape))
    conv.bias.copy_(b)
    padding = tuple(conv.padding)
    if padding == (0, 0):
        return nn.Identity()
    conv.padding = (0, 0)
    return PadWith(mean.expand(conv.in_channels) if mean.dim() == 0 else mean, padding)


def fold_input_normalization(model: nn.Module, example: torch.Tensor | None = None) -> nn.Module:
    """A copy of the model ready for quantization: every BatchNorm whose input is a Conv2d's output folded into
    that conv (int8 deployment's rule: a quantized layer computes conv + BN in one), and the data set's
    Normalize folded into the conv that reads it, so that conv sees raw pixels (>= 0, exactly representable as
    uint8 codes with scale 1/255). The folds are exact up to float rounding, so the copy's fp32 outputs equal
    the model's (eval mode). A Normalize that feeds more than one module, or a grouped conv, stays as it is
    (the first layer then sees signed inputs).

    example: one input batch, to find which module feeds which (default: zeros of model.input_shape)."""
    folded = copy.deepcopy(model).eval()
    if example is None:
        example = torch.zeros(1, *getattr(model, "input_shape", (1, 28, 28)))
    device = next((p.device for p in folded.parameters()), torch.device("cpu"))
    bn_of, (norm_name, readers) = _trace(folded, example[:1].to(device))
    for bn_name, conv_name in bn_of.items():
        bn = folded.get_submodule(bn_name)
        if bn.running_mean is None or bn.running_var is None:
            continue
        fold_batchnorm(folded.get_submodule(conv_name), bn)
        set_module(folded, bn_name, nn.Identity())
    if norm_name is not None and len(readers) == 1:
        reader = folded.get_submodule(readers[0])
        if isinstance(reader, nn.Conv2d) and reader.groups == 1 and reader.padding_mode == "zeros" \
                and not isinstance(reader.padding, str):
            set_module(folded, norm_name, _fold_normalize(reader, folded.get_submodule(norm_name)))
    return folded
