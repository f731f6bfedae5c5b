"""Which quantized layer's output reaches which quantized layer as codes (requant=integer's hand-offs).

A layer's requantized output is fl(code * s) at its consumer's scale s; the consumer's quantize recovers the
code exactly. Between the two, only steps that act on those values as on codes may run: ReLU, max-pooling,
flattening and reshaping, identity, dropout in eval mode, and a clamp such as ReLU6 when, at the consumer's
scale, it changes no code (clamps_keep_codes). The model's forward is traced with torch.fx to find them, so
any model's chains are found, not only those of models that list their steps (stages()). Anything else ends
a chain: a second reader of a value on the way (a residual block's input feeds its conv and its shortcut),
an add, a concatenation, average pooling, a module that is not one of those steps."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn

from runner.quant import act_qrange, quantize_act

# (lower, upper) bounds of the clamps on a chain; a lower bound of 0 (ReLU's, ReLU6's) acts on codes as on values
Clamps = tuple[tuple[float, float], ...]
RELU: Clamps = ((0.0, float("inf")),)

_PLAIN_MODULES = (nn.Flatten, nn.Identity)
_PLAIN_FUNCTIONS = {F.relu, F.relu_, torch.relu, torch.relu_, torch.flatten}
_PLAIN_METHODS = {"relu", "relu_", "flatten", "view", "reshape", "contiguous"}
_CLAMP_FUNCTIONS = {F.hardtanh: (-1.0, 1.0), F.hardtanh_: (-1.0, 1.0), F.relu6: (0.0, 6.0)}
_MAX_POOLS = {F.max_pool1d, F.max_pool2d, F.max_pool3d}
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d}
# what reads only a value's shape, not its codes: x.view(x.size(0), -1) still hands x's codes on
_METADATA_METHODS = {"size", "dim"}
_METADATA_ATTRS = {"shape", "ndim", "dtype", "device"}


def module_clamps(module: nn.Module) -> Clamps | None:
    """The clamps a module applies if it hands codes on unchanged otherwise, None if it is not such a step."""
    if isinstance(module, _PLAIN_MODULES):
        return ()
    if isinstance(module, nn.ReLU):  # a module the model calls, so it can pass codes through (_PassesCodes)
        return RELU
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        return None if module.return_indices else ()
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return None if module.training and module.p > 0 else ()
    if isinstance(module, nn.Hardtanh):  # nn.ReLU6 included
        return ((float(module.min_val), float(module.max_val)),)
    if isinstance(module, nn.Sequential):
        found: list = []
        for child in module:
            clamps = module_clamps(child)
            if clamps is None:
                return None
            found += clamps
        return tuple(found)
    return None


def _function_clamps(node: fx.Node) -> Clamps | None:
    target, kwargs = node.target, node.kwargs
    if node.op == "call_method":
        return () if target in _PLAIN_METHODS else None
    if target in _PLAIN_FUNCTIONS:
        return ()
    if target in _MAX_POOLS:  # (input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
        return None if kwargs.get("return_indices", node.args[6] if len(node.args) > 6 else False) else ()
    if target in _DROPOUTS:
        return None if kwargs.get("training", True) and kwargs.get("p", 0.5) > 0 else ()
    if target in _CLAMP_FUNCTIONS:
        lo, hi = _CLAMP_FUNCTIONS[target]
        bounds = [kwargs.get("min_val", lo), kwargs.get("max_val", hi)]
        for i, value in enumerate(node.args[1:3]):  # bounds passed by position
            bounds[i] = value
        if not all(isinstance(b, (int, float)) for b in bounds):
            return None
        return ((float(bounds[0]), float(bounds[1])),)
    return None


def clamps_keep_codes(clamps: Clamps, scale: torch.Tensor, signed: bool) -> bool:
    """Whether the clamps act on every code c a consumer at `scale` can read as ReLU does (c -> max(c, 0), lower
    bound 0) or not at all (lower bound below 0): clamping fl(c * scale), as the producer hands it on, and
    quantizing at `scale` with the consumer's own quantize gives that code back, decided over the whole code
    range on the CPU. A clamp whose upper bound lies inside the range (ReLU6 at a scale for codes above 6)
    would change codes: no hand-off through it then."""
    if not clamps:
        return True
    s = scale.detach().float().cpu().reshape(())
    qmin, qmax = act_qrange(signed)
    codes = torch.arange(qmin, qmax + 1, dtype=torch.float32)
    values = codes * s  # one float32 rounding, as the requantize kernels' code * out_scale
    expected = codes
    for lo, hi in clamps:
        if lo > 0 or hi <= 0:
            return False
        values = values.clamp(lo, hi)
        if lo == 0:
            expected = expected.clamp_min(0)
    return bool(torch.equal(quantize_act(values, s, signed).float(), expected))


CODES_ATTR = "_approx_codes"  # set on a producer's requantized output whose way to its consumer has clamps
RELU_ATTR = "_approx_relu"  # set on a producer's output that it applied the ReLU it reaches next to (relu_applied)
RELU_END: Clamps = ((0.0, float("inf")), (0.0, float("inf")))  # find_consumers' mark of a ReLU end (no consumer)


class _PassesCodes:
    """A clamp module on a hand-off (a ReLU or ReLU6 between two linked layers). Its producer requantized to the
    consumer's codes with the clamps' lower bound 0 applied (qmin 0), and at the consumer's scale the clamps change
    no code (clamps_keep_codes), so the clamp passes the producer's output through: the consumer reads the same
    codes, and a forward saves the clamp's launch and its pass over the tensor (torchvision MobileNetV2: 34 of its
    35 ReLU6s; ResNet-18: 8 of its 17 ReLU calls, the module shared with the residual adds, whose sums it still
    clamps). Values above the upper bound may then reach the consumer unclamped; its quantize maps them to the
    codes clamped ones give."""

    def forward(self, x):
        return x if getattr(x, CODES_ATTR, False) else super().forward(x)


class CodesHardtanh(_PassesCodes, nn.Hardtanh):
    pass


class CodesReLU6(_PassesCodes, nn.ReLU6):
    pass


class CodesReLU(_PassesCodes, nn.ReLU):
    def forward(self, x):  # also what its producer already applied the ReLU to (relu_applied)
        return x if getattr(x, RELU_ATTR, False) else super().forward(x)


_PASSING = {nn.Hardtanh: CodesHardtanh, nn.ReLU6: CodesReLU6, nn.ReLU: CodesReLU}


def pass_codes_through_clamps(model: nn.Module) -> None:
    """Every nn.ReLU / nn.Hardtanh / nn.ReLU6 of the model passes a producer's marked output through
    (_PassesCodes); anything else it clamps as before."""
    for m in model.modules():
        passing = _PASSING.get(type(m))
        if passing is not None:
            m.__class__ = passing


class _Tracer(fx.Tracer):
    """Keeps the quantized layers, and every module without one inside, as single calls."""

    def __init__(self, leaves: set[int]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.leaves


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read node's values (not only its shape)."""
    def metadata(user):
        return (user.op == "call_method" and user.target in _METADATA_METHODS) or \
            (user.op == "call_function" and user.target is getattr and user.args[1:2] and
             user.args[1] in _METADATA_ATTRS)
    return [u for u in node.users if not metadata(u)]


def _reads_only_first(node: fx.Node, value: fx.Node) -> bool:
    """value is node's first argument and appears nowhere else in its arguments."""
    if not node.args or node.args[0] is not value:
        return False
    seen: list = []
    fx.node.map_arg((node.args[1:], node.kwargs), seen.append)
    return value not in seen


def _graph_consumers(model: nn.Module, is_layer) -> dict:
    modules = dict(model.named_modules())
    holds_layer = {id(m) for m in modules.values() if any(is_layer(s) for s in m.modules())}
    leaves = {id(m) for m in modules.values() if is_layer(m) or id(m) not in holds_layer}
    graph = _Tracer(leaves).trace(model)
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and is_layer(modules[node.target]):
            calls.setdefault(node.target, []).append(node)
    found = {}
    for name, nodes in calls.items():
        if len(nodes) != 1:  # one layer called at two places: no single consumer
            continue
        value, clamps, steps, relu_end = nodes[0], (), (), None
        while True:
            readers = _readers(value)
            if len(readers) != 1 or not _reads_only_first(readers[0], value):
                break
            step = readers[0]
            if step.op == "call_module":
                module = modules[step.target]
                if is_layer(module):
                    found[name] = (step.target, clamps, steps)
                    break
                if relu_end is None and steps is not None and type(module) in (nn.ReLU, CodesReLU) and \
                        all(type(modules[s]) is nn.Identity for s in steps):
                    relu_end = (step.target, RELU_END, steps)
                more = module_clamps(module)
                steps = None if steps is None else steps + (step.target,)
            elif step.op in ("call_function", "call_method"):
                more, steps = _function_clamps(step), None
            else:
                more = None
            if more is None:
                break
            value, clamps = step, clamps + more
        if name not in found and relu_end is not None:
            found[name] = relu_end
    return found


def _stage_consumers(model: nn.Module, is_layer) -> dict:
    """The same walk over the steps the model's stages() lists in forward order (a straight chain)."""
    name_of = {id(m): n for n, m in model.named_modules()}
    steps = [step for _, step in model.stages()]
    found = {}
    for i, step in enumerate(steps):
        if not is_layer(step):
            continue
        clamps: Clamps = ()
        for nxt in steps[i + 1:]:
            if is_layer(nxt):  # what else the forward does between them is unknown: no steps (None)
                found[name_of[id(step)]] = (name_of[id(nxt)], clamps, None)
                break
            more = module_clamps(nxt)
            if more is None:
                break
            clamps += more
    return found


def find_consumers(model: nn.Module, is_layer) -> dict[str, tuple[str, Clamps, tuple[str, ...] | None]]:
    """{layer name: (its consumer's name, the clamps on the way, the modules on the way or None where a function
    is among the steps)} for the modules is_layer accepts; for a layer with no consumer whose output a ReLU module
    reads next (through Identity modules alone: a folded BatchNorm), (that ReLU's name, RELU_END, those Identity
    modules): the layer may apply the ReLU in its last pass (relu_applied). The forward
    is traced symbolically (no data runs); a forward fx cannot trace (control flow on values, say) falls back
    to the model's stages() if it has them, else links nothing, as requant=float hands every value on."""
    try:
        return _graph_consumers(model, is_layer)
    except Exception:  # noqa: BLE001  (tracing a user's forward can fail in any way; no link is always correct)
        pass
    if hasattr(model, "stages"):
        try:
            return _stage_consumers(model, is_layer)
        except Exception:  # noqa: BLE001
            pass
    return {}


HANDED_ATTR = "_approx_handed"  # (codes, consumer) on a placeholder for fl(codes * the consumer's input scale)
SIDE_ATTR = "_approx_side"  # (codes, consumer, version) on a float output whose consumer's codes came with it


def _passes_unchanged(module: nn.Module) -> bool:
    """module's forward returns its (marked) input itself: an identity, a passing clamp, a Sequential of them."""
    if type(module) is nn.Sequential:
        return all(_passes_unchanged(m) for m in module)
    return type(module) is nn.Identity or isinstance(module, _PassesCodes)


def _hooked(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


class ForwardScope:
    """How many forwards of the model are in progress (its own hooks count them): a layer hands codes alone only
    inside one, where fx's trace says its consumer reads them next, never when called by itself."""

    def __init__(self):
        self.depth = 0

    def enter(self, module, args):
        self.depth += 1

    def leave(self, module, args, output):
        self.depth -= 1


@contextlib.contextmanager
def in_forward(model: nn.Module):
    """A forward of model for its layers' hand-offs where its own hooks do not run (a CUDA graph's capture)."""
    scope = model.__dict__.get("_forward_scope")
    if scope is None:
        yield
        return
    scope.enter(model, ())
    try:
        yield
    finally:
        scope.leave(model, (), None)


@dataclass(frozen=True)
class HandOffPath:
    """The modules between a layer and its consumer (find_consumers' steps), and the model's ForwardScope."""
    scope: ForwardScope
    steps: tuple[nn.Module, ...]


def hand_off_path(model: nn.Module, steps: list[nn.Module]) -> HandOffPath:
    scope = model.__dict__.get("_forward_scope")
    if scope is None:  # one a model, however often link_consumers runs on it
        scope = model.__dict__["_forward_scope"] = ForwardScope()
        model.register_forward_pre_hook(scope.enter)
        model.register_forward_hook(scope.leave, always_call=True)
    return HandOffPath(scope, tuple(steps))


def codes_alone(producer: nn.Module, consumer: nn.Module, path: HandOffPath | None) -> bool:
    """Whether producer may hand consumer its codes alone, no float tensor: inside a forward of the model, where
    nothing but consumer can read the value. The steps between them are modules that return it unchanged (no
    function of the forward, which fx found, reads it), no hook on them, on either layer or global could see
    it, and autograd is off (consumer's training path reads floats; handed_float gives them back)."""
    if path is None or path.scope.depth <= 0 or torch.is_grad_enabled() or _global_hooks():
        return False
    steps = path.steps  # their types checked here, not once at linking: a module's class may change after it
    return all(_passes_unchanged(m) for m in steps) and not any(_hooked(m) for m in (producer, consumer, *steps))


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def hand_codes(codes: torch.Tensor, consumer: nn.Module) -> torch.Tensor:
    """The producer's output when codes_alone: a float placeholder of the output's shape that holds no memory,
    marked for the passing clamps on the way and carrying the codes for consumer (handed_codes)."""
    out = mark_codes(codes.new_empty((), dtype=torch.float32).expand(codes.shape))
    setattr(out, HANDED_ATTR, (codes, consumer))
    return out


def side_codes_for(consumer: nn.Module | None, like: torch.Tensor):
    """(an empty int8 / uint8 tensor of like's shape, consumer's input scale) for a layer's last pass to fill with
    consumer's input codes of its output, where consumer is a LUT layer with a static scale on like's device and
    autograd is off (its forward reads codes then); else None."""
    if consumer is None or not getattr(consumer, "lut_layer", False) or consumer.dynamic or torch.is_grad_enabled():
        return None
    scale = consumer.input_scale(None).detach()
    if scale.device != like.device:
        return None
    return torch.empty(like.shape, dtype=torch.int8 if consumer.signed else torch.uint8, device=like.device), scale


def hand_side_codes(out: torch.Tensor, codes: torch.Tensor, consumer: nn.Module) -> torch.Tensor:
    """out, carrying consumer's input codes of it (side_codes_for, filled): consumer reads them instead of quantizing
    out, while out has not changed since (its version); every other reader takes out itself."""
    setattr(out, SIDE_ATTR, (codes, consumer, out._version))
    return out


def relu_applied(out: torch.Tensor) -> torch.Tensor:
    """out, marked as its producer's output with the ReLU the producer reaches next applied (find_consumers' RELU_END
    link, where codes_alone allows it: nothing else could see the values before the ReLU): that ReLU (CodesReLU)
    passes it through."""
    setattr(out, RELU_ATTR, True)
    return out


def mark_codes(out: torch.Tensor) -> torch.Tensor:
    """out, marked as a requantized output whose clamps on the way pass it through (_PassesCodes)."""
    setattr(out, CODES_ATTR, True)
    return out


def handed_codes(x: torch.Tensor, consumer: nn.Module) -> torch.Tensor | None:
    """The codes handed to consumer with x (hand_codes, or hand_side_codes while x is unchanged since), None for an
    ordinary input."""
    handed = getattr(x, HANDED_ATTR, None)
    if handed is None:
        side = getattr(x, SIDE_ATTR, None)
        return side[0] if side is not None and side[1] is consumer and side[2] == x._version else None
    if handed[1] is not consumer:  # never by codes_alone's conditions; no layer may read a placeholder
        raise RuntimeError("a LUT layer's codes reached a layer other than their consumer")
    return handed[0]


def handed_float(x: torch.Tensor) -> torch.Tensor:
    """x itself, or the values a placeholder stands for: fl(code * scale), what the producer's requantize gives."""
    handed = getattr(x, HANDED_ATTR, None)
    if handed is None:
        return x
    codes, consumer = handed
    return codes.float() * consumer.input_scale(None).detach()


# A residual block's end: its last layer's output, (folded BatchNorm's Identity,) + the shortcut, (a ReLU). Where that
# layer is a LUT layer (lut_layer) and nothing else could see the values between, inference computes the sum
# and the ReLU in the layer's last pass (approx::dequantize's residual: the same float operations, the same bits),
# not in up to three more passes over the output. The block classes are swapped for subclasses whose forward does
# so and otherwise runs the original one (fx traces the original: the links above stay what they were).
@dataclass(frozen=True)
class BlockEnd:
    steps: list[nn.Module]        # what runs before the last layer, in order, as the block's forward runs it
    last: nn.Module               # the last layer, then its BatchNorm (folded: Identity)
    norm: nn.Module
    shortcut: nn.Module | None    # None: the block's input itself
    relu: nn.Module | None        # the ReLU after the sum (None: none)
    bypassed: tuple[nn.Module, ...] = ()  # containers whose children run here without their own call (hooks)


def _resnet_end(*names: str):
    """The end of a block that computes relu(bn(last(...)) + shortcut(x)), its steps named in order."""
    def end(block):
        shortcut = getattr(block, "downsample", None) if hasattr(block, "downsample") else block.shortcut
        return BlockEnd([getattr(block, n) for n in names[:-2]], getattr(block, names[-2]), getattr(block, names[-1]),
                        shortcut, block.relu)
    return end


def _torchvision_inverted_end(block):  # x + conv(x), conv = [..., project Conv2d, BatchNorm2d]; no ReLU
    return BlockEnd(list(block.conv)[:-2], block.conv[-2], block.conv[-1], None, None, (block.conv,)) \
        if block.use_res_connect else None


def _zoo_inverted_end(block):  # x + project(depthwise(expand(x))), project = [Conv2d, BatchNorm2d]
    return BlockEnd([block.expand, block.depthwise], block.project[0], block.project[1], None, None,
                    (block.project,)) if block.residual else None


_BLOCK_ENDS = {  # (module, class): its end (exactly those classes, not subclasses with forwards of their own)
    ("torchvision.models.resnet", "BasicBlock"): _resnet_end("conv1", "bn1", "relu", "conv2", "bn2"),
    ("torchvision.models.resnet", "Bottleneck"): _resnet_end("conv1", "bn1", "relu", "conv2", "bn2", "relu",
                                                             "conv3", "bn3"),
    ("runner.models.resnet", "BasicBlock"): _resnet_end("conv1", "bn1", "relu", "conv2", "bn2"),
    ("torchvision.models.mobilenetv2", "InvertedResidual"): _torchvision_inverted_end,
    ("runner.models.mobilenetv2", "InvertedResidual"): _zoo_inverted_end,
}
_FUSED: dict[type, type] = {}


class _FusedEnd:
    """Mixin of a residual block whose last LUT layer adds the shortcut and applies the ReLU (see above)."""

    def forward(self, x):
        end = None if isinstance(x, fx.Proxy) else _BLOCK_ENDS[self._block_key](self)
        if end is None or not self._fuses(end, x):
            return super().forward(x)
        residual = x if end.shortcut is None else end.shortcut(x)
        out = x
        for step in end.steps:
            out = step(out)
        nxt = self.__dict__.get("_next_block")  # its first layer reads this block's output next: its codes come along
        return end.last(out, residual=residual, relu=end.relu is not None,
                        codes_for=None if nxt is None else _first_layer(nxt))

    @staticmethod
    def _fuses(end: BlockEnd, x: torch.Tensor) -> bool:
        """Nothing could see the values between: no hook on the last layer, its BatchNorm, the ReLU or a container
        passed over, none global; the BatchNorm folded, the ReLU a plain one, a LUT layer last, a float32 input."""
        return (getattr(end.last, "lut_layer", False) and type(end.norm) is nn.Identity
                and x.dtype == torch.float32 and (end.relu is None or type(end.relu) in (nn.ReLU, CodesReLU))
                and not _global_hooks() and not any(_hooked(m) for m in (end.last, end.norm, end.relu) if m is not None)
                and not any(m._forward_hooks or m._forward_pre_hooks for m in end.bypassed))


def _fused_class(block: type) -> type:
    fused = _FUSED.get(block)
    if fused is None:
        name = f"Fused{block.__module__.replace('.', '_')}_{block.__name__}"
        key = (block.__module__, block.__name__)
        fused = type(name, (_FusedEnd, block), {"_block_key": key, "__module__": __name__})
        fused.__qualname__ = name
        _FUSED[block] = globals()[name] = fused
    return fused


def __getattr__(name: str):
    """A fused block class by name (unpickling a model saved with them): made from its original on demand."""
    import importlib

    for module, cls in _BLOCK_ENDS:
        if name == f"Fused{module.replace('.', '_')}_{cls}":
            return _fused_class(getattr(importlib.import_module(module), cls))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _first_layer(block: nn.Module) -> nn.Module:
    """The module a block of _BLOCK_ENDS' kinds calls first on its input (its first conv, inside a Sequential)."""
    first = block.conv1 if hasattr(block, "conv1") else block.conv[0] if hasattr(block, "conv") else \
        block.depthwise if type(block.expand) is nn.Identity else block.expand
    while isinstance(first, nn.Sequential) and len(first):
        first = first[0]
    return first


def fuse_residual_ends(model: nn.Module) -> None:
    """Swap the model's residual blocks of the known kinds (_BLOCK_ENDS: torchvision's BasicBlock, Bottleneck and
    InvertedResidual, the zoo's BasicBlock and InvertedResidual; exactly those classes, not subclasses with forwards
    of their own) for their fused subclasses; a block that a Sequential runs right after another hands its first
    layer's input codes on from the other's end (side codes, checked by identity and version where read)."""
    for m in model.modules():
        if (type(m).__module__, type(m).__name__) in _BLOCK_ENDS and not isinstance(m, _FusedEnd):
            m.__class__ = _fused_class(type(m))
    for seq in model.modules():  # a block followed by another in a Sequential: the next one's first layer's codes
        if type(seq) is nn.Sequential:
            for block, nxt in zip(seq, list(seq)[1:]):
                if isinstance(block, _FusedEnd) and isinstance(nxt, _FusedEnd):
                    object.__setattr__(block, "_next_block", nxt)  # a plain attribute, not a submodule
