"""What a quantized layer refuses to compute silently: an int32 accumulator that could overflow, and NaN or
Inf where an 8-bit code is needed (checked on the CPU at once, on a GPU through flags read after the
forward)."""
from __future__ import annotations

import math

import torch
from torch import nn

from runner.errors import UserError

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def reduction_length(layer: nn.Module) -> int:
    """K: how many products one output sums (in_features; in_channels / groups * kernel area)."""
    if isinstance(layer, nn.Conv2d):
        return layer.in_channels // layer.groups * math.prod(layer.kernel_size)
    return layer.in_features


def check_accumulator(name: str, k: int, bounds: tuple[int, int]) -> None:
    """The int32 accumulator sums k table entries, so it lies in [k * min(lut), k * max(lut)]; when that
    interval fits int32, no input can overflow it (the kernels would wrap silently). Raise otherwise.
    bounds: the table's (min, max), Multiplier.value_bounds."""
    lo, hi = bounds
    if k * hi <= INT32_MAX and k * lo >= INT32_MIN:
        return
    widest = max(abs(lo), abs(hi))
    k_max = min(INT32_MAX // hi if hi > 0 else k, INT32_MIN // lo if lo < 0 else k)
    raise UserError(f"layer {name}: sums K={k:,} products of a table ranging {lo:,}..{hi:,}, so its int32 "
                    f"accumulator could reach {k * (hi if hi >= -lo else lo):,}, past the int32 range; with this table "
                    f"a layer may sum at most K={k_max:,} products (K = in_features, or in_channels / groups * "
                    f"kernel area). Split the layer, or use a table whose largest |product| is at most "
                    f"{INT32_MAX // k:,} (this one's is {widest:,}).")


def check_finite(name: str, what: str, t: torch.Tensor) -> None:
    """NaN or Inf would silently become some activation or weight code; say where it came in instead."""
    # a NaN or Inf anywhere makes the sum non-finite: one cheap reduction, the exact test only then
    if bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()):
        return
    bad = t[~torch.isfinite(t)]
    raise _non_finite(name, what, f"{bad.numel():,} non-finite value(s) (first: {bad[0].item()})")


def _non_finite(name: str, what: str, found: str) -> UserError:
    return UserError(f"layer {name}: {what} holds {found}, which have no 8-bit code. Check the input data, the "
                     "checkpoint, or a retraining run that diverged (lower finetune.lr).")


class NonFiniteInputCheck:
    """Forward hook of a converted model: reports the first layer whose input held NaN or Inf.

    On the CPU a layer checks its input itself and raises at once. On a GPU the layers only set a flag on the
    device (the approx layers' quantize kernel sets it as it reads the input: no extra launch), and reading
    the flags at the end of a forward would make the host wait for the whole forward (a visible share of a
    LeNet-5 forward on a GPU). So each forward starts an asynchronous copy of its flags, and the
    next forward, or check() after the last one, reads it. Evaluation loops call check() after their last
    batch, when their own copies of the outputs have waited for the device already."""

    def __init__(self):
        self._pending = None

    def __call__(self, model: nn.Module, inputs=None, output=None) -> None:
        self.check()
        # the quantized layers (runner.layers) that saw a non-finite input since the last check
        flagged = [(n, m) for n, m in model.named_modules() if getattr(m, "_input_flagged", False)]
        if not flagged:
            return
        for _, m in flagged:
            m._input_flagged = False
        flags = torch.cat([m.nonfinite_input for _, m in flagged])
        if not flags.is_cuda:
            self._raise(flagged, flags)
            return
        host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(flags.device))  # the copy's stream, whichever GPU is current
        self._pending = (flagged, host, done)

    def check(self) -> None:
        """Raise for the last forward whose flags were not read yet (waits for its copy)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            flagged, host, done = pending
            done.synchronize()
            self._raise(flagged, host)

    @staticmethod
    def _raise(flagged, seen: torch.Tensor) -> None:
        if not seen.any():
            return
        for _, m in flagged:
            m.nonfinite_input.zero_()
        name = next(n for (n, _), bad in zip(flagged, seen.tolist()) if bad)
        raise _non_finite(name, "the input", "non-finite values")

    def __deepcopy__(self, memo):  # a copied model starts with nothing pending (a CUDA event does not copy)
        return NonFiniteInputCheck()


def check_non_finite_inputs(model: nn.Module) -> None:
    """After a converted model's last forward on a GPU: raise if some layer's input held NaN or Inf."""
    for hook in model._forward_hooks.values():
        if isinstance(hook, NonFiniteInputCheck):
            hook.check()
