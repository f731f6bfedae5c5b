"""Functional reads of a layer's weight routed through the layer.

A module may compute `F.linear(x, self.fc.weight, self.fc.bias)` itself instead of calling self.fc: calibration
would never see fc's input, and after conversion the product would still be taken in float with the fp32 weight.
RouteWeights, a forward pre-hook and hook pair on the model's root, runs each forward under a TorchFunctionMode
that turns every F.linear / F.conv2d whose weight is a Linear's / Conv2d's (or a converted layer's) weight, called
outside that layer's own forward, into a call of the layer: its hooks (calibration) see the input, and a converted
layer computes its quantized forward. torchao's quantize_ routes F.linear the same way, through a tensor subclass
on the weight; a mode leaves the weights plain tensors (state dicts, deep copies, in-place folds unchanged).
The owners are looked up on every forward from the module the hook is given, so a deep copy routes to its own
layers. explicit_attention installs it where a probe forward finds such a read."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from runner.errors import UserError

_ROUTED = {F.linear: 0, F.conv2d: 0}


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    # converted layers (runner.layers' quantized Conv2d/Linear, which say so by this attribute rather than by a
    # class this package would have to import: runner.layers imports runner.attention) read their weight too
    return {id(m.weight): (name, m) for name, m in model.named_modules()
            if (isinstance(m, (nn.Linear, nn.Conv2d)) or getattr(m, "routes_weight_reads", False))
            and isinstance(getattr(m, "weight", None), torch.Tensor)}


class _Mode(TorchFunctionMode):
    def __init__(self, owners):
        super().__init__()
        self.owners, self.active, self.routed = owners, set(), set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ROUTED:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            hit = self.owners.get(id(weight))
            if hit is not None and id(hit[1]) not in self.active:
                return self._route(func, hit, args, kwargs)
        return func(*args, **kwargs)

    def _route(self, func, hit, args, kwargs):
        name, layer = hit
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        extra = args[3:] if func is F.conv2d else ()
        same_geometry = func is F.linear or (
            all(k in ("input", "weight", "bias") for k in kwargs) and not extra) or _conv_args_match(layer, extra)
        own_bias = getattr(layer, "bias", None)
        if not same_geometry or not (bias is own_bias or (bias is None and _zero_or_none(own_bias))):
            raise UserError(f"layer {name}'s weight is read by {func.__name__} with another bias or geometry than "
                            f"the layer's own, which conversion cannot route through the layer: call the module "
                            f"({name}(x)) instead, or leave {name} out of model.approx_layers.")
        self.routed.add(name)
        return layer(args[0] if args else kwargs["input"])

    def enter_layer(self, module):
        self.active.add(id(module))

    def leave_layer(self, module):
        self.active.discard(id(module))


def _zero_or_none(bias) -> bool:
    return bias is None or not bool(bias.detach().ne(0).any())


def _conv_args_match(layer, extra) -> bool:
    own = (tuple(layer.stride), tuple(layer.padding), tuple(layer.dilation), layer.groups)
    given = list(extra) + [(1, 1), (0, 0), (1, 1), 1][len(extra):]
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    return (pair(given[0]), pair(given[1]), pair(given[2]), int(given[3])) == own


class RouteWeights:
    """The root's forward pre-hook and hook (one object, stateless between forwards: deep copies share it)."""

    def __init__(self):
        self._stack = []

    def pre(self, model, args):
        mode = _Mode(_owners(model))
        hooks = []
        for _, layer in mode.owners.values():
            hooks.append(layer.register_forward_pre_hook(lambda m, a, mode=mode: mode.enter_layer(m)))
            hooks.append(layer.register_forward_hook(lambda m, a, o, mode=mode: mode.leave_layer(m), always_call=True))
        mode.__enter__()
        self._stack.append((mode, hooks))

    def post(self, model, args, out):
        mode, hooks = self._stack.pop()
        mode.__exit__(None, None, None)
        for h in hooks:
            h.remove()
        return None

    def __deepcopy__(self, memo):
        return RouteWeights()


def route_weights(model: nn.Module) -> nn.Module:
    """Install the routing on the model's root (once)."""
    if any(isinstance(getattr(h, "__self__", None), RouteWeights) for h in model._forward_pre_hooks.values()):
        return model
    router = RouteWeights()
    model.register_forward_pre_hook(router.pre)
    model.register_forward_hook(router.post, always_call=True)
    return model


@torch.no_grad()
def functional_reads(model: nn.Module, example: torch.Tensor) -> set[str]:
    """The layers whose weight some forward step reads outside the layer's own forward, from one forward."""
    router = RouteWeights()
    router.pre(model, (example,))
    mode = router._stack[-1][0]
    try:
        model(example)
    finally:
        router.post(model, (example,), None)
    return mode.routed
