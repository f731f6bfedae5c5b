"""Quantized layers and model conversion.

FakeQuantConv2d/Linear: fp32 layers whose input and weight pass through quantize-dequantize.
ApproxConv2d/Linear ("custom MAC"): the same codes, multiplied through a 256x256 LUT by
runner.ops (python reference, C++ or CUDA kernels) and summed exactly in int32.
Both take their scales from runner.quant, so they differ only in the multiply: at inference fake-quant
sums the products of the same codes exactly (exact_conv2d) and finishes like the LUT layers
(runner.ops.finish), so with the exact table the two give the same bits, on every device."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from runner import lut_slopes, ops, ops_autograd
from runner.attention import MatMul, explicit_attention, use_matmuls
from runner.attention.quantized import ApproxMatMul, FakeQuantMatMul, QuantizedMatMul
from runner.code_map import identity_code_map
from runner.errors import UserError
from runner.exact_conv import exact_conv2d, exact_linear
from runner.float64_steps import float64_steps
from runner.layer_checks import NonFiniteInputCheck, check_accumulator, check_finite, reduction_length
from runner.linking import (RELU_END, clamps_keep_codes, codes_alone, find_consumers, fuse_residual_ends, hand_codes,
                            hand_off_path, hand_side_codes, handed_codes, handed_float, mark_codes,
                            pass_codes_through_clamps, relu_applied, side_codes_for)
from runner.pooling import pair_pools
from runner.models import fold_input_normalization, set_module
from runner.quant import (ActStats, QuantConfig, act_qrange, act_scale_from_amax, calibrate, dequantized_bias,
                          dynamic_amax, fake_quant_act, fake_quant_act_lsq, fake_quant_weight_ste, quant_layers,
                          quantize_act, quantize_bias, quantize_weight, requant_multiplier, select_layers, weight_clip,
                          weight_scale)


# what the layers an evaluation does not approximate compute
OTHER_LAYERS = ("fp32", "fakequant")


class _Quantized(nn.Module):
    """Quantization state shared by the fake-quant and LUT variants of a layer.

    weight and bias are trainable parameters. The weight scale (and the LUT variant's codes) follow the
    weights: recomputed after each change (an optimizer step, load_state_dict) and written in place, so
    the kernels' table caches, keyed on tensor content (cpp) or identity and version counter (cuda), see
    every change. Between changes they are reused: inference never requantizes the weights."""

    routes_weight_reads = True  # runner.attention.routing: an F.linear reading .weight goes through this layer

    def __init__(self, layer: nn.Module, signed: bool, qcfg: QuantConfig, stats: ActStats | None,
                 name: str = "?"):
        super().__init__()
        self.layer_name = name
        # on a GPU: set on the device when an input holds NaN/Inf, read by NonFiniteInputCheck; not state
        self.register_buffer("nonfinite_input", torch.zeros(1, dtype=torch.bool), persistent=False)
        self._input_flagged = False  # the flag was handed to the device since the hook last read it
        check_finite(name, "the weight", layer.weight.detach())
        if layer.bias is not None:
            check_finite(name, "the bias", layer.bias.detach())
        if stats is not None:
            check_finite(name, "the calibrated input range", torch.tensor([stats.min, stats.amax_signed]))
        self.signed = bool(signed)
        self.dynamic = qcfg.activation == "dynamic"
        self.requant = qcfg.requant
        self._requant_cache = None
        # requant=integer: the quantized layer this one's output reaches as codes, the clamps and modules on the
        # way (link_consumers). Plain attributes: modules of the model already, not submodules.
        object.__setattr__(self, "_consumer", None)
        self._link_clamps, self._link_steps = (), None  # steps: a linking.HandOffPath
        self._relu_end = None  # (the ReLU module its output reaches next, the HandOffPath there): find_consumers
        self.granularity = qcfg.weight
        # below 1 only while retraining (set_weight_scale_factor): weight scale factor * max|w| / 127
        self.weight_scale_factor = 1.0
        self.weight = nn.Parameter(layer.weight.detach().clone())
        bias = layer.bias.detach().clone() if layer.bias is not None else torch.zeros(layer.weight.shape[0])
        self.bias = nn.Parameter(bias)
        self.register_buffer("weight_scale", weight_scale(self.weight, qcfg.weight))
        amax = torch.tensor(float("nan") if stats is None else
                            (stats.amax_signed if signed else stats.amax_unsigned))
        self.register_buffer("act_scale", act_scale_from_amax(amax, signed))
        self._weight_seen = self._weight_state()

    def _weight_state(self):
        return (self.weight.data_ptr(), self.weight._version)

    @torch.no_grad()
    def refresh_weight_quant(self) -> None:
        """Requantize the weights if they changed since the last call."""
        state = self._weight_state()
        if state == self._weight_seen:
            return
        # A training step on a GPU skips this check's host wait (one per layer and step): a non-finite weight
        # makes the layer's output non-finite, which the next layer's input flag and the loss report without
        # waiting. Inference after any change (load, the last step) still checks here. Train mode, not grad
        # mode, tells them apart: this method runs under no_grad.
        if not (self.weight.is_cuda and self.training):
            check_finite(self.layer_name, "the weight", self.weight.detach())
        self.weight_scale.copy_(weight_scale(self.weight, self.granularity, self.weight_scale_factor))
        self._requantized()
        self._weight_seen = self._weight_state()

    @torch.no_grad()
    def set_weight_scale_factor(self, factor: float) -> None:
        """Weight scales factor * max|w| / 127 from now on (factor < 1: larger codes; the weights beyond the
        codes' range clip, and the STE masks their gradient). Going back to 1 first clamps each channel's
        weights to +-factor * max|w|, so the plain rule (max|w| / 127) gives the same scales and codes: the
        model computes the same, and a checkpoint of it reloads to the same outputs."""
        if factor == self.weight_scale_factor:
            return
        if factor == 1.0:
            bound = weight_clip(self.weight, self.granularity, self.weight_scale_factor)
            bound = bound.to(self.weight.device).view((-1,) + (1,) * (self.weight.dim() - 1))
            self.weight.copy_(torch.minimum(torch.maximum(self.weight, -bound), bound))
        self.weight_scale_factor = float(factor)
        self._weight_seen = None
        self.refresh_weight_quant()  # the buffers a state dict saves hold the scales and codes this factor gives

    def _requantized(self) -> None:
        pass

    def _weight_codes(self) -> torch.Tensor:
        """quantize_weight's codes of the present weights at the present scales, computed once per change of either
        (tensor and version, as the kernels' table caches key them), not once per inference forward: fake-quant's
        inference forward reads them (runner.finetune also runs that forward on LUT layers)."""
        key = tuple((t.data_ptr(), t._version, t.device) for t in (self.weight, self.weight_scale))
        cached = self.__dict__.get("_weight_codes_cache")
        if cached is None or cached[0] != key:
            cached = self._weight_codes_cache = (key, quantize_weight(self.weight, self.weight_scale))
        return cached[1]

    def _check_input(self, x: torch.Tensor, defer: bool | None = None) -> None:
        """Check x here (CPU), or note on the device whether it holds NaN/Inf (GPU, or defer=True)."""
        flag = self._input_flag(x, defer)
        if flag is not None:
            ops.mark_non_finite(flag, x)

    def _input_flag(self, x: torch.Tensor, defer: bool | None = None) -> torch.Tensor | None:
        """The flag for a kernel that reads x anyway to set (on a GPU), or None after checking x here."""
        if not (x.is_cuda if defer is None else defer):
            check_finite(self.layer_name, "the input", x)
            return None
        self._input_flagged = True
        return self.nonfinite_input

    def _read_kernel_flag(self, x: torch.Tensor) -> None:
        """The flag the quantize kernel set as it read x (_input_flag(x, defer=True), in place of a pass of our
        own over x), read right after the layer's kernels on the CPU; on a GPU after the forward
        (NonFiniteInputCheck). On the CPU the kernel's flag is read without a wait: a non-finite input stops
        the forward in this layer, with check_finite's message (which counts the bad values only then)."""
        if self.nonfinite_input.is_cuda:
            return
        self._input_flagged = False
        if bool(self.nonfinite_input):
            self.nonfinite_input.zero_()
            check_finite(self.layer_name, "the input", x)

    def input_scale(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic:
            return act_scale_from_amax(dynamic_amax(x, self.signed), self.signed)
        log_scale = getattr(self, "act_log_scale", None)
        return self.act_scale if log_scale is None else log_scale.exp()

    def learn_act_scale(self, on: bool = True) -> None:
        """Train the static activation scale with the weights (on), or fix its trained value into the act_scale
        buffer (off). Learned as log(scale), so an optimizer step changes it by a ratio, not by an amount
        that would be huge for a scale of 0.01 and nothing for one of 10. Dynamic scales are never learned."""
        if on and not self.dynamic and getattr(self, "act_log_scale", None) is None:
            self.act_log_scale = nn.Parameter(self.act_scale.detach().log())
        elif not on and getattr(self, "act_log_scale", None) is not None:
            with torch.no_grad():
                self.act_scale.copy_(self.act_log_scale.exp())
            del self.act_log_scale

    def _fake_quant_input(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.input_scale(x)
        if scale.requires_grad and torch.is_grad_enabled():  # LSQ: torch's learnable fake-quant, without its wait
            return fake_quant_act_lsq(x, scale, self.signed)
        return fake_quant_act(x, scale, self.signed)

    def _scale_source(self) -> torch.Tensor:
        """The tensor the static input scale is read from (its version says when the scale changed)."""
        return getattr(self, "act_log_scale", None) if getattr(self, "act_log_scale", None) is not None \
            else self.act_scale

    def _finish_args(self, scale: torch.Tensor):
        """(bias, requant) of runner.ops.finish for an inference forward at input scale `scale`.
        requant=float: the float bias, no requantization. requant=integer: the bias as int32 at s_a * s_w, and
        with a quantized consumer next, the requantize arguments (its codes, at its scale); without one (the
        logits, a residual add's input; or a ReLU6 on the way that would clip codes at the consumer's present
        scale), the int32 bias dequantized for the fp32 output.
        Computed on the CPU once per change of the scales or the bias, so every backend gets the same values
        and a forward neither launches extra kernels nor waits for the device."""
        if self.requant != "integer":
            return self.bias, None
        if self.dynamic:  # a new scale every batch, no consumer: on the device, without waiting for it
            return dequantized_bias(quantize_bias(self.bias, scale, self.weight_scale), scale, self.weight_scale), None
        consumer = self.__dict__["_consumer"]
        sources = (self._scale_source(), self.weight_scale, self.bias,
                   None if consumer is None else consumer._scale_source())
        key = tuple(None if t is None else (t.data_ptr(), t._version, t.device) for t in sources)
        if self._requant_cache is None or self._requant_cache[0] != key:
            self._requant_cache = (key, self._integer_finish(scale))
        return self._requant_cache[1]

    def _code_consumer(self):
        """The layer this one hands codes to at that layer's present scale: its linked consumer, unless there is
        none or a clamp on the way (ReLU6) would clip codes at that scale."""
        consumer = self.__dict__["_consumer"]
        if consumer is None or not clamps_keep_codes(self._link_clamps, consumer.input_scale(None).detach(),
                                                     consumer.signed):
            return None
        return consumer

    def _integer_finish(self, scale: torch.Tensor):
        dev = self.weight_scale.device
        sa, sw = scale.detach().float().cpu().reshape(()), self.weight_scale.detach().cpu()
        bias_q = quantize_bias(self.bias.detach().cpu(), sa, sw)
        consumer = self._code_consumer()
        if consumer is None:
            return dequantized_bias(bias_q, sa, sw).to(dev), None
        out_scale = consumer.input_scale(None).detach()
        m0, shift = requant_multiplier(sa.double() * sw.double() / out_scale.double().cpu())
        qmin, qmax = act_qrange(consumer.signed)
        if any(lo == 0 for lo, _ in self._link_clamps):  # a ReLU's lower bound, as it acts on codes: the clamp
            qmin = max(qmin, 0)                          # then passes these through (linking._PassesCodes)
        return None, (bias_q.to(dev), m0.to(dev), shift.to(dev), out_scale, qmin, qmax)

    def _hand_on(self, out, requant):
        return mark_codes(out) if requant is not None and self._link_clamps else out

    def set_act_amax(self, stats: ActStats) -> None:
        """Static activation scale from new calibration statistics (recalibration after retraining)."""
        amax = torch.tensor(stats.amax_signed if self.signed else stats.amax_unsigned)
        self.act_scale.copy_(act_scale_from_amax(amax, self.signed))


def _needs_grad(x: torch.Tensor, layer: nn.Module, scale: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or layer.weight.requires_grad or layer.bias.requires_grad
                                        or scale.requires_grad)


class _ConvOps:
    def _init_conv(self, layer: nn.Conv2d):
        if layer.padding_mode != "zeros" or isinstance(layer.padding, str):
            raise UserError(f"conv layer with padding={layer.padding!r}, padding_mode={layer.padding_mode!r} "
                            "is not supported; use numeric zero padding")
        self.stride, self.padding = tuple(layer.stride), tuple(layer.padding)
        self.dilation, self.groups = tuple(layer.dilation), layer.groups

    def _float_op(self, x, w, b):
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def _autograd_forward(self, x, scale):
        return ops_autograd.qconv2d(x, self.weight, self.bias, self.weight_codes, self.weight_scale, scale, self.lut,
                                    *self._slopes(), *self._geometry(), self.signed, self.backend, self.algo, self.grad)

    def _inference_forward(self, x, scale, bias, requant, **kw):
        return ops_autograd.qforward_conv2d(x, self.weight_codes, self.weight_scale, scale, bias, self.lut,
                                            *self._geometry(), self.signed, self.backend, self.algo, requant=requant, **kw)

    def _geometry(self):  # the ops' stride, padding, dilation, groups
        return list(self.stride), list(self.padding), list(self.dilation), self.groups

    def _exact_acc(self, codes, weight_codes):
        return exact_conv2d(codes, weight_codes, self.stride, self.padding, self.dilation, self.groups, integer=False)


class _LinearOps:
    linear_layer = True  # runner.models.stages_of: a torchvision model flattens before its first Linear, converted or not

    def _float_op(self, x, w, b):
        return F.linear(x, w, b)

    def _autograd_forward(self, x, scale):
        return ops_autograd.qlinear(x, self.weight, self.bias, self.weight_codes, self.weight_scale, scale, self.lut,
                                    *self._slopes(), self.signed, self.backend, self.algo, self.grad)

    def _inference_forward(self, x, scale, bias, requant, **kw):
        return ops_autograd.qforward_linear(x, self.weight_codes, self.weight_scale, scale, bias, self.lut,
                                            self.signed, self.backend, self.algo, requant=requant, **kw)

    def _exact_acc(self, codes, weight_codes):
        """[M, N] (finish's channel dim 1); forward restores the leading dims."""
        return exact_linear(codes.reshape(-1, codes.shape[-1]), weight_codes)


class _FakeQuant(_Quantized):
    def forward(self, x):
        self.refresh_weight_quant()
        self._check_input(x.detach())
        scale = self.input_scale(x)
        if _needs_grad(x, self, scale):  # training: torch's fake-quant in fp32, whose autograd is torch's own
            return self._float_op(self._fake_quant_input(x), fake_quant_weight_ste(self.weight, self.weight_scale),
                                  self.bias)
        # inference: the same codes' products summed exactly, then the LUT layers' own last step, so the
        # result does not depend on the device's float sums (cuDNN, TF32) and equals the exact table's. The sums
        # stay in the float dtype they are exact in (_exact_acc): finish converts exact integers as it would int64.
        acc = self._exact_acc(quantize_act(x, scale, self.signed), self._weight_codes())
        bias, requant = self._finish_args(scale)
        out = ops.finish(acc, scale, self.weight_scale, bias, requant, backend="python")
        return self._hand_on(out if acc.dim() == x.dim() else out.reshape(*x.shape[:-1], out.shape[-1]), requant)


class _Approx(_Quantized):
    lut_layer = True  # forward(x, residual=, relu=, codes_for=), reads handed codes: runner.linking

    def __init__(self, layer, multiplier, qcfg, stats, backend: str, algo: str, grad: str = "ste", name: str = "?"):
        k = reduction_length(layer)
        check_accumulator(name, k, multiplier.value_bounds)
        super().__init__(layer, multiplier.signed, qcfg, stats, name)
        self.multiplier_name, self.backend, self.algo = multiplier.name, backend, algo
        self.reduction_k = k
        self.register_buffer("lut", multiplier.lut.to(torch.int32).contiguous())
        # the code stored for each code m (index m + 128): the identity unless retraining fitted the table's own
        # (runner.code_map); part of the state, so a saved retrained model reloads to the same codes
        self.register_buffer("weight_code_map", identity_code_map())
        self.register_buffer("weight_codes", quantize_weight(self.weight, self.weight_scale).contiguous())
        self.grad = "ste"
        self.set_grad(grad)

    def set_multiplier(self, multiplier) -> None:
        """Multiply through another table of the same signedness: the layer's quantized state does not
        depend on the table, so a command evaluating many tables converts the model once. The table
        tensor is replaced, never written in place: it may be the multiplier's own (shared with every
        layer and model made from it), and the kernels' table caches see a new tensor as a new table."""
        if multiplier.signed != self.signed:
            raise ValueError(f"layer {self.layer_name} is {'un' * (not self.signed)}signed, multiplier "
                             f"{multiplier.name} is not")
        check_accumulator(self.layer_name, self.reduction_k, multiplier.value_bounds)
        self.lut = multiplier.lut.to(device=self.lut.device, dtype=torch.int32).contiguous()
        self.multiplier_name = multiplier.name
        self._slope_cache = None

    def set_grad(self, grad: str, slope_window: int = 1) -> None:
        """Which gradient a training forward records: "ste" or "lut" (see runner.ops), and for "lut" over how
        many codes either side the table's slopes are taken."""
        ops_autograd.check_grad_mode(grad)
        self.grad, self.slope_window = grad, int(slope_window)
        self._slope_cache = None

    def _slopes(self):
        if self.grad != "lut":
            empty = self.lut.new_empty(0, dtype=torch.float32)
            return empty, empty
        key = (self.lut.data_ptr(), self.lut._version, self.lut.device)
        if self._slope_cache is None or self._slope_cache[0] != key:
            self._slope_cache = (key, lut_slopes.slope_tables(self.lut, self.signed, self.slope_window))
        return self._slope_cache[1]

    def _requantized(self) -> None:
        codes = quantize_weight(self.weight, self.weight_scale)
        self.weight_codes.copy_(self.weight_code_map[codes.to(torch.int64) + 128])

    @torch.no_grad()
    def set_weight_code_map(self, code_map: torch.Tensor) -> None:
        """Store code_map[m + 128] for every weight code m from now on (runner.code_map), and requantize."""
        self.weight_code_map.copy_(code_map.to(self.weight_code_map.device, torch.int8))
        self._weight_seen = None
        self.refresh_weight_quant()

    def forward(self, x, residual: torch.Tensor | None = None, relu: bool = False, codes_for=None):
        """The layer's output; with a residual (float, the output's shape), output + residual, then with relu its
        ReLU: a residual block's end, which inference computes in the layer's last pass (linking.fuse_residual_ends);
        codes_for: the LUT layer that reads that output next, whose input codes the same pass writes (side codes)."""
        self.refresh_weight_quant()
        self._last_input_shape = tuple(x.shape)  # for auto_picks: auto picks per call shape
        scale = self.input_scale(x)
        if _needs_grad(x, self, scale):  # training: the differentiable op, which takes no flag
            x = handed_float(x)
            self._check_input(x.detach())
            out = self._autograd_forward(x, scale)
            return out if residual is None and not relu else ops.block_end(out, residual, relu)
        bias, requant = self._finish_args(scale)
        codes, consumer = handed_codes(x, self), self.__dict__["_consumer"]
        # the consumer's signedness where it alone reads the output (and reads codes): those, not fl(code * s)
        signed = consumer.signed if requant is not None and residual is None and not relu and \
            codes_alone(self, consumer, self._link_steps) else None
        flag = self._input_flag(x, defer=True) if codes is None else None  # handed codes are finite
        relu_end = residual is None and requant is None and self._relu_end is not None and \
            codes_alone(self, *self._relu_end)
        side = side_codes_for(codes_for, residual) if residual is not None and requant is None else None
        end = None if residual is None and not (relu or relu_end) else \
            ops.LayerEnd(residual, relu or relu_end, *(side or ()))
        out = self._inference_forward(x, scale, bias, requant, nonfinite=flag, codes=codes, codes_signed=signed,
                                      end=end)
        self._read_kernel_flag(x)  # (a flag still clear where codes were handed)
        if residual is not None or relu_end:
            return hand_side_codes(out, side[0], codes_for) if side else relu_applied(out) if relu_end else out
        return self._hand_on(out, requant) if signed is None else hand_codes(out, consumer)

    def auto_pick(self) -> str:
        """The kernel variant `auto` runs for this layer's last input shape, from the kernels' own
        choice function (approx::lut_algos on the layer's weights and LUT; "" when it has not
        chosen yet, or the layer runs another algo or the python reference)."""
        shape = getattr(self, "_last_input_shape", None)
        if self.algo != "auto" or self.backend == "python" or shape is None:
            return ""
        dtype = torch.int8 if self.signed else torch.uint8
        conv = isinstance(self, ApproxConv2d)
        codes = torch.zeros(shape if conv else (math.prod(shape[:-1]), shape[-1]), dtype=dtype,
                            device=self.weight_codes.device)
        args = (self.stride, self.padding, self.dilation, self.groups) if conv else ()
        rows = ops.algo_table(codes, self.weight_codes, self.lut, *args, backend=self.backend)
        return next((r["auto_pick_name"] for r in rows if r["auto_pick"]), "")

    def extra_repr(self):
        return (f"multiplier={self.multiplier_name}, signed={self.signed}, backend={self.backend}, algo={self.algo}, "
                f"grad={self.grad}")


class FakeQuantConv2d(_ConvOps, _FakeQuant):
    def __init__(self, layer: nn.Conv2d, signed: bool, qcfg: QuantConfig, stats: ActStats | None, name: str = "?"):
        super().__init__(layer, signed, qcfg, stats, name)
        self._init_conv(layer)


class FakeQuantLinear(_LinearOps, _FakeQuant):
    pass


class ApproxConv2d(_ConvOps, _Approx):
    def __init__(self, layer: nn.Conv2d, multiplier, qcfg: QuantConfig, stats: ActStats | None,
                 backend: str = "python", algo: str = "auto", name: str = "?"):
        super().__init__(layer, multiplier, qcfg, stats, backend, algo, name=name)
        self._init_conv(layer)


class ApproxLinear(_LinearOps, _Approx):
    pass


def auto_picks(model: nn.Module) -> dict[str, str]:
    """{layer: the kernel variant auto chose for its last input} for the model's LUT layers."""
    return {name: m.auto_pick() for name, m in model.named_modules() if isinstance(m, _Approx)}


def _per_layer(multipliers, names: list[str]) -> dict:
    if isinstance(multipliers, dict):
        missing = [n for n in names if n not in multipliers]
        if missing:
            raise UserError(f"no multiplier given for layer(s) {missing}.")
        return multipliers
    return {n: multipliers for n in names}


def check_signedness(multipliers: dict, stats: dict[str, ActStats]) -> None:
    for name, m in multipliers.items():
        # an attention product's operands have no such limit: an unsigned table multiplies them sign-magnitude
        if not m.signed and name in stats and stats[name].min < 0 and stats[name].other is None:
            raise UserError(
                f"multiplier {m.name} is unsigned, but the input of layer {name} takes negative values "
                f"(min {stats[name].min:.4g} over the calibration data), which uint8 codes cannot hold. "
                f"Use a signed multiplier (mul8s_*) for {name}, or leave it out of model.approx_layers.")


def convert_model(model: nn.Module, multipliers, qcfg: QuantConfig, stats: dict[str, ActStats],
                  backend: str = "python", algo: str = "auto", layers=None, fake: bool = False,
                  others: str = "fp32") -> nn.Module:
    """A copy of `model` whose Conv2d/Linear layers (all, or those named) do every multiply through the
    multiplier's LUT (fake=False) or through fake-quant at the same scales (fake=True); the layers not named
    stay fp32 (others="fp32") or become fake-quant with their multiplier's signedness (others="fakequant").
    Trained weights are copied. `multipliers` is one Multiplier or {layer name: Multiplier}; `stats` comes
    from calibrate(). The float steps between the layers (LayerNorm, softmax, GELU, a global average pool)
    compute in float64, rounded once (runner.float64_steps): the CPU and a GPU give the same float32 values there,
    but for about one element in 2^28."""
    if others not in OTHER_LAYERS:
        raise UserError(f"model.other_layers={others!r}: choose {' or '.join(OTHER_LAYERS)}.")
    names = select_layers(model, layers)
    converted = list(quant_layers(model)) if others == "fakequant" else names
    per_layer = _per_layer(multipliers, converted)
    check_signedness({n: per_layer[n] for n in converted}, stats)
    out = copy.deepcopy(model)
    for name in converted:
        new = converted_layer(out.get_submodule(name), name, per_layer[name], qcfg, stats, backend, algo,
                         fake or name not in names)
        set_module(out, name, new)
    pair_pools(out)
    float64_steps(out)  # the CPU's and a GPU's float32 kernels round them differently: a last bit can change a code
    link_consumers(out)
    fuse_residual_ends(out)
    out.register_forward_hook(NonFiniteInputCheck())
    return out.eval()


def converted_layer(layer: nn.Module, name: str, multiplier, qcfg: QuantConfig, stats: dict[str, ActStats], backend: str,
               algo: str, fake: bool) -> nn.Module:
    """The fake-quant (fake) or LUT layer that replaces the float `layer` named `name`."""
    st = None if qcfg.activation == "dynamic" else stats[name]
    if isinstance(layer, MatMul):  # an attention product: its operands' signedness from calibration either way
        st = stats.get(name)
        return FakeQuantMatMul(multiplier.signed, qcfg, st, name=name) if fake else \
            ApproxMatMul(multiplier, qcfg, st, backend, name=name)
    conv = isinstance(layer, nn.Conv2d)
    if fake:
        return (FakeQuantConv2d if conv else FakeQuantLinear)(layer, multiplier.signed, qcfg, st, name=name)
    return (ApproxConv2d if conv else ApproxLinear)(layer, multiplier, qcfg, st, backend, algo, name=name)


def link_consumers(model: nn.Module, links: dict | None = None) -> None:
    """For requant=integer: each quantized layer's consumer is the one quantized (static-scale) layer its
    output alone reaches through code-preserving steps (runner.linking: ReLU, max-pool, flatten, identity,
    eval dropout, ReLU6 where it keeps codes), found by tracing the forward with torch.fx; the layer then
    requantizes to the consumer's codes. A layer with no such consumer (the logits; a value read twice, as a
    residual block's input; an add's, a concat's, an average pool's input; every layer of a model fx cannot
    trace and that has no stages()) dequantizes to fp32, which the next layer quantizes as in requant=float."""
    layers = quantized_layers(model)
    pass_codes_through_clamps(model)
    for m in layers.values():
        object.__setattr__(m, "_consumer", None)
        m._link_clamps, m._link_steps, m._requant_cache, m._relu_end = (), None, None, None
    if links is None:
        links = consumer_links(model)
    modules = dict(model.named_modules())
    for name, (consumer, clamps, steps) in links.items():
        if clamps is RELU_END:  # no consumer; a ReLU module next
            layers[name]._relu_end = (modules[consumer], hand_off_path(model, [modules[s] for s in steps]))
        elif not layers[consumer].dynamic:
            object.__setattr__(layers[name], "_consumer", layers[consumer])
            layers[name]._link_clamps = clamps
            path = steps is not None and isinstance(layers[consumer], _Approx)  # a consumer that reads handed codes
            layers[name]._link_steps = hand_off_path(model, [modules[s] for s in steps]) if path else None


def consumer_links(model: nn.Module) -> dict:
    """find_consumers over the model's Conv2d/Linear layers: what link_consumers applies (traced once, reusable
    while the model's structure stays: runner.layer_swaps)."""
    return find_consumers(model, lambda m: isinstance(m, _Quantized))


def integer_links(model: nn.Module) -> dict[str, str]:
    """{layer: the layer it hands codes to} at the consumers' present scales (requant=integer)."""
    layers = quantized_layers(model)
    names = {id(m): n for n, m in layers.items()}
    return {name: names[id(c)] for name, m in layers.items()
            if m.requant == "integer" and not m.dynamic and (c := m._code_consumer()) is not None}


def quantized_models(model: nn.Module, multipliers, qcfg: QuantConfig, calib_x: torch.Tensor,
                     backend: str = "python", algo: str = "auto", layers=None,
                     seed: int = 0) -> tuple[nn.Module, nn.Module, dict[str, ActStats]]:
    """(fakequant model, approx model, calibration stats) from a trained fp32 model: BatchNorm and the input
    normalisation folded into the convs before them (runner.models.fold_input_normalization), inputs
    calibrated on calib_x (on the CPU, in float64: runner.quant.calibrate), then both conversions from the
    same statistics. The folds run on a CPU copy: folded weights computed on a GPU could differ in their last
    bits, and with them every scale and code."""
    folded = fold_input_normalization(copy.deepcopy(model).cpu(), calib_x[:1].cpu())
    stats = calibrate(folded, calib_x, qcfg, seed=seed)
    fq = convert_model(folded, multipliers, qcfg, stats, fake=True, layers=layers)
    approx = convert_model(folded, multipliers, qcfg, stats, backend=backend, algo=algo, layers=layers)
    return fq, approx, stats


def approximate(model: nn.Module, multiplier, calib_x: torch.Tensor, quant: QuantConfig | None = None,
                backend: str = "cpp", layers=None, seed: int = 0, matmuls: bool = False) -> tuple[nn.Module, nn.Module]:
    """The Python API for any trained nn.Module (docs/models.md): (fake-quant int8 model, model whose chosen
    Conv2d/Linear layers multiply through the table), both in eval mode on the CPU. multiplier: a name or spec
    as `multiplier=` takes it (mul8s_1L2J, exact, a table file) or a Multiplier, or {layer: one of those};
    layers: names and globs as model.approx_layers (None: all); calib_x: training inputs for the scales.
    Attention (nn.MultiheadAttention, torchvision's Swin) is made explicit first and functional reads of a
    layer's weight are routed through the layer (runner.attention.explicit_attention); matmuls=True makes each
    attention's Q.K^T and P.V layers too (`<attention>.qk`, `<attention>.av`; model.approx_matmuls)."""
    from runner.multipliers import resolve

    def one(spec):
        return spec if hasattr(spec, "lut") else resolve(spec)

    multipliers = {n: one(m) for n, m in multiplier.items()} if isinstance(multiplier, dict) else one(multiplier)
    if isinstance(multipliers, dict) and layers is None:
        layers = list(multipliers)
    model = explicit_attention(copy.deepcopy(model).cpu().eval(), calib_x[:1].cpu())
    use_matmuls(model, matmuls)
    fq, approx, _ = quantized_models(model, multipliers, quant or QuantConfig(), calib_x,
                                     backend=backend, layers=layers, seed=seed)
    return fq, approx


def quantized_layers(model: nn.Module, weights_only: bool = False) -> dict[str, nn.Module]:
    """The converted layers: Conv2d/Linear (_Quantized) and, unless weights_only, the attention products."""
    kinds = _Quantized if weights_only else (_Quantized, QuantizedMatMul)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def learn_act_scales(model: nn.Module, on: bool = True) -> None:
    """Every quantized layer's static activation scale trainable (on) or fixed at its trained value (off)."""
    for m in quantized_layers(model).values():
        m.learn_act_scale(on)


def set_grad_mode(model: nn.Module, grad: str, slope_window: int = 1) -> None:
    """The gradient every LUT layer of `model` records in training ("ste" or "lut", see _Approx.set_grad)."""
    for m in model.modules():
        if isinstance(m, (_Approx, ApproxMatMul)):
            m.set_grad(grad, slope_window)
