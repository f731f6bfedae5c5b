"""Differentiable layer ops: float input -> quantize -> LUT MAC -> dequantize -> float output.

The forward composes the integer ops of runner.ops; this module adds what only the float level knows:
the custom ops approx::qlinear / approx::qconv2d / approx::qmatmul and their registered autograd.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from runner.errors import UserError
from runner.exact_conv import unfold
from runner.ops import (LayerEnd, apply_end, conv_out_shape, finish, lut_bmm, lut_conv2d, lut_conv2d_dequantize,
                        lut_conv2d_requantize_codes, lut_grad_a, lut_grad_w, lut_linear, quantize, requantize_codes)

# Autograd lives here, on float-level ops, not on lut_linear / lut_conv2d: those take integer codes,
# which have no gradient, and the gradient of a quantized layer needs what only the float level
# knows (the clipping masks of the quantizers, the scales). So approx::qlinear / approx::qconv2d are
# Python custom ops whose forward composes the integer ops (quantize, lut_*, dequantize on the
# chosen backend) and whose backward is registered with torch.library.register_autograd:
#   grad="ste"  straight-through: the gradient of the exact product of the dequantized operands,
#               times the quantizers' clipping masks -- exactly what fake-quant's autograd computes
#               (the same aten calls on the same fake-quantized tensors).
#   grad="lut"  the multiplier's own slopes (slope_tables) in place of the exact operands:
#               dL/dx[m,k] = mask_x * sum_n g[m,n] s_w[n] dP/da(a[m,k], w[n,k])
#               dL/dW[n,k] = mask_w * s_a * sum_m g[m,n] dP/dw(a[m,k], w[n,k])
#               through approx::lut_grad_a / lut_grad_w (their reference, runner.reference, on backend=python).
# The weight scale is a constant of the step (it follows the weights: runner.layers refreshes it after
# each step). The activation scale is too, unless it requires grad: then it gets the LSQ gradient
# (_scale_grad), the same as torch's learnable fake-quant gives the QAT model.
GRADS = ("ste", "lut")


def check_grad_mode(grad):
    if grad not in GRADS:
        raise UserError(f"finetune.grad={grad!r}: choose {' or '.join(GRADS)}.")


def qforward_linear(x, weight_codes, weight_scale, act_scale, bias, lut, signed, backend, algo, nonfinite=None,
                     requant=None, codes=None, codes_signed=None, end: LayerEnd | None = None):
    """Inference: x's codes (given as `codes`, handed on by the previous layer, or quantized here), the LUT
    sums, then finish; with codes_signed (the next layer's signedness, not None), requant's codes themselves
    (requantize_codes: that layer's input codes, no float tensor); `end` (ops.LayerEnd: a residual block's end,
    the next layer's codes) on the output, of the output's shape."""
    if codes is None:
        codes = quantize(x.contiguous(), act_scale, signed, backend=backend, nonfinite=nonfinite)
    lead = codes.shape[:-1]
    acc = lut_linear(codes.reshape(-1, codes.shape[-1]), weight_codes, lut, backend=backend, algo=algo)
    shape = (*lead, acc.shape[-1])
    rows = None  # end as [M, N] rows, where its tensors have the output's shape
    if end is not None and end.fits_shape(shape):
        rows = LayerEnd(None if end.residual is None else end.residual.contiguous().reshape(acc.shape), end.relu,
                        None if end.codes is None else end.codes.view(acc.shape), end.codes_scale)
    out = _finish_or_codes(acc, act_scale, weight_scale, bias, requant, codes_signed, backend, rows).reshape(shape)
    return out if end is None or rows is not None else apply_end(out, end, backend)  # a broadcast residual


def qforward_conv2d(x, weight_codes, weight_scale, act_scale, bias, lut, stride, padding, dilation, groups,
                     signed, backend, algo, nonfinite=None, requant=None, codes=None, codes_signed=None,
                     end: LayerEnd | None = None):
    """qforward_linear's steps for a conv."""
    if codes is None:
        codes = quantize(x.contiguous(), act_scale, signed, backend=backend, nonfinite=nonfinite)
    if end is not None and end.residual is not None:
        end = dataclasses.replace(end, residual=end.residual.contiguous())
    conv = (codes, weight_codes, lut, stride, padding, dilation, groups)
    # the conv and its end in one op where the end is one the op takes (a kernel may apply it in its stores)
    if codes_signed is not None:
        bias_q, m0, shift, _, qmin, qmax = requant
        return lut_conv2d_requantize_codes(*conv, bias_q, m0, shift, qmin, qmax, codes_signed, backend=backend,
                                           algo=algo)
    if requant is None and (end is None or end.fits_shape(conv_out_shape(codes.shape, weight_codes.shape, stride,
                                                                          padding, dilation))):
        e = end or LayerEnd()
        return lut_conv2d_dequantize(*conv, act_scale, weight_scale, bias, e.residual, e.relu, e.codes, e.codes_scale,
                                     backend=backend, algo=algo)
    acc = lut_conv2d(*conv, backend=backend, algo=algo)
    return _finish_or_codes(acc, act_scale, weight_scale, bias, requant, codes_signed, backend, end)


def _finish_or_codes(acc, act_scale, weight_scale, bias, requant, codes_signed, backend, end=None):
    if codes_signed is None:
        return finish(acc, act_scale, weight_scale, bias, requant, backend=backend, end=end)
    bias_q, m0, shift, _, qmin, qmax = requant
    return requantize_codes(acc, bias_q, m0, shift, qmin, qmax, codes_signed, backend=backend)


@torch.library.custom_op("approx::qlinear", mutates_args=())
def qlinear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, weight_codes: torch.Tensor,
            weight_scale: torch.Tensor, act_scale: torch.Tensor, lut: torch.Tensor, slope_a: torch.Tensor,
            slope_w: torch.Tensor, signed: bool, backend: str, algo: str, grad: str) -> torch.Tensor:
    """Linear layer through the LUT: x float [..., K], weight float [N, K] (its codes and scale given,
    so kernels reuse their cached tables), act_scale 0-d. slope_a/slope_w: slope_tables() for grad="lut"
    (unused, may be empty, for "ste")."""
    return qforward_linear(x, weight_codes, weight_scale, act_scale, bias, lut, signed, backend, algo)


@torch.library.custom_op("approx::qconv2d", mutates_args=())
def qconv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, weight_codes: torch.Tensor,
            weight_scale: torch.Tensor, act_scale: torch.Tensor, lut: torch.Tensor, slope_a: torch.Tensor,
            slope_w: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int], groups: int,
            signed: bool, backend: str, algo: str, grad: str) -> torch.Tensor:
    """Conv2d through the LUT, float in and out (see qlinear)."""
    return qforward_conv2d(x, weight_codes, weight_scale, act_scale, bias, lut, stride, padding, dilation,
                            groups, signed, backend, algo)


@qlinear.register_fake
def _(x, weight, bias, weight_codes, weight_scale, act_scale, lut, slope_a, slope_w, signed, backend, algo, grad):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@qconv2d.register_fake
def _(x, weight, bias, weight_codes, weight_scale, act_scale, lut, slope_a, slope_w, stride, padding, dilation,
      groups, signed, backend, algo, grad):
    return x.new_empty(conv_out_shape(x.shape, weight.shape, stride, padding, dilation))


def _fake_quant_with_mask(x, scale, qmin, qmax):
    """(x_q, mask): torch's fake-quant output and clipping mask, with its arithmetic (q = nearbyint(x * (1/s)),
    x_q = clamp(q) * s, mask = q inside [qmin, qmax]) in plain ops, which unlike aten's cachemask kernels
    have fake (meta) implementations, so the op traces under torch.compile and opcheck."""
    q = torch.round(x * scale.reciprocal())
    return q.clamp(qmin, qmax) * scale, (q >= qmin) & (q <= qmax)


def _fake_quant_masks(x, weight, weight_scale, act_scale, signed):
    """(x_q, mask_x, w_q, mask_w): fake-quant's own outputs and clipping masks, so the STE gradient is
    fake-quant's gradient."""
    from runner.quant import WEIGHT_QMAX, act_qrange

    xq, mask_x = _fake_quant_with_mask(x, act_scale, *act_qrange(signed))
    shape = (-1,) + (1,) * (weight.dim() - 1)
    wq, mask_w = _fake_quant_with_mask(weight, weight_scale.reshape(shape), -WEIGHT_QMAX, WEIGHT_QMAX)
    return xq, mask_x, wq, mask_w


def _setup_context(ctx, inputs, output):
    x, weight, bias, weight_codes, weight_scale, act_scale, lut, slope_a, slope_w = inputs[:9]
    ctx.save_for_backward(x, weight, weight_codes, weight_scale, act_scale, slope_a, slope_w)
    ctx.conv = len(inputs) > 13
    if ctx.conv:
        ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs[9:13]
    ctx.signed, ctx.backend, ctx.algo, ctx.grad = inputs[-4:]


def _lut_rows_grads(ctx, codes, weight_codes, g_rows, weight_scale, act_scale, slope_a, slope_w, need_x, need_w):
    """The `lut` gradient in rows form (codes [M, K], g_rows [M, N]): (d codes-space input, d weight)."""
    gx = gw = None
    if need_x:
        gx = lut_grad_a(codes, weight_codes, (g_rows * weight_scale).contiguous(), slope_a, backend=ctx.backend)
    if need_w:
        gw = lut_grad_w(codes, weight_codes, g_rows.contiguous(), slope_w, backend=ctx.backend) * act_scale
    return gx, gw


def _scale_grad(gxq, x, xq, mask_x, act_scale):
    """Gradient of the activation scale (LSQ, Esser et al. 2020; what torch's learnable fake-quant computes):
    x_q = s * clamp(round(x / s)), so dx_q/ds = q - x/s inside the range and q where clipped."""
    q = xq / act_scale
    return (gxq * torch.where(mask_x, q - x / act_scale, q)).sum().reshape(act_scale.shape)


def _finish(ctx, gxq, gw, x, xq, mask_x, mask_w, act_scale):
    """Input, weight and activation-scale gradients from the gradient at the fake-quantized input."""
    need_x, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[5]
    gs = _scale_grad(gxq, x, xq, mask_x, act_scale) if need_s else None
    gx = gxq * mask_x if need_x else None
    return gx, (None if gw is None else gw * mask_w), gs


def _backward_linear(ctx, g):
    x, weight, weight_codes, weight_scale, act_scale, slope_a, slope_w = ctx.saved_tensors
    need_xq = ctx.needs_input_grad[0] or ctx.needs_input_grad[5]
    need_w, need_b = ctx.needs_input_grad[1:3]
    xq, mask_x, wq, mask_w = _fake_quant_masks(x, weight, weight_scale, act_scale, ctx.signed)
    k, n = x.shape[-1], weight.shape[0]
    g2 = g.reshape(-1, n)
    gxq = gw = gb = None
    if ctx.grad == "ste":
        # the aten calls F.linear's autograd makes (addmm backward), so the sums round alike
        if need_xq:
            gxq = g2.mm(wq).reshape(x.shape)
        if need_w:
            gw = xq.reshape(-1, k).t().mm(g2).t()
    else:
        codes = _codes_of(xq, act_scale, ctx.signed).reshape(-1, k)
        gxq, gw = _lut_rows_grads(ctx, codes, weight_codes, g2, weight_scale, act_scale, slope_a, slope_w,
                                  need_xq, need_w)
        gxq = None if gxq is None else gxq.reshape(x.shape)
    gx, gw, gs = _finish(ctx, gxq, gw, x, xq, mask_x, mask_w, act_scale)
    if need_b:
        gb = g2.sum(0)
    return gx, gw, gb, None, None, gs, *([None] * 7)


def _backward_conv2d(ctx, g):
    x, weight, weight_codes, weight_scale, act_scale, slope_a, slope_w = ctx.saved_tensors
    need_xq = ctx.needs_input_grad[0] or ctx.needs_input_grad[5]
    need_w, need_b = ctx.needs_input_grad[1:3]
    xq, mask_x, wq, mask_w = _fake_quant_masks(x, weight, weight_scale, act_scale, ctx.signed)
    gb = None
    if ctx.grad == "ste":
        # the one aten call F.conv2d's autograd makes
        gxq, gw, gb = torch.ops.aten.convolution_backward(
            g, xq, wq, [weight.shape[0]], ctx.stride, ctx.padding, ctx.dilation, False, [0, 0], ctx.groups,
            [need_xq, need_w, need_b])
    else:
        gxq, gw = _lut_conv_grads(ctx, _codes_of(xq, act_scale, ctx.signed), weight_codes, g, weight_scale,
                                  act_scale, slope_a, slope_w, need_xq, need_w)
        if need_b:
            gb = g.sum((0, 2, 3))
    gx, gw, gs = _finish(ctx, gxq, gw, x, xq, mask_x, mask_w, act_scale)
    return gx, gw, gb, None, None, gs, *([None] * 11)


def _codes_of(xq, act_scale, signed):
    """The activation codes of fake-quantized values (exact: x_q is an integer times the scale)."""
    return torch.round(xq / act_scale).to(torch.int8 if signed else torch.uint8)


def _lut_conv_grads(ctx, codes, weight_codes, g, weight_scale, act_scale, slope_a, slope_w, need_x, need_w):
    """The `lut` gradient of a conv: its codes unfolded into rows (padding = code 0), the rows-form
    gradients per group, the input gradient folded back (padding positions drop out)."""
    b, c, h, wd = codes.shape
    n, cg, kh, kw = weight_codes.shape
    groups, ng, kg = ctx.groups, n // ctx.groups, cg * kh * kw
    cols = unfold(codes.to(torch.float32), (kh, kw), ctx.dilation, ctx.padding, ctx.stride)  # [B, C*kh*kw, L]
    length = cols.shape[2]
    gcols, gws = [], []
    for gi in range(groups):
        rows = cols[:, gi * kg:(gi + 1) * kg, :].transpose(1, 2).reshape(-1, kg).to(codes.dtype).contiguous()
        g_rows = g[:, gi * ng:(gi + 1) * ng].reshape(b, ng, length).transpose(1, 2).reshape(-1, ng)
        w_rows = weight_codes[gi * ng:(gi + 1) * ng].reshape(ng, kg)
        gx, gw = _lut_rows_grads(ctx, rows, w_rows, g_rows, weight_scale[gi * ng:(gi + 1) * ng], act_scale,
                                 slope_a, slope_w, need_x, need_w)
        if gx is not None:
            gcols.append(gx.reshape(b, length, kg).transpose(1, 2))
        if gw is not None:
            gws.append(gw.reshape(ng, cg, kh, kw))
    gx = (F.fold(torch.cat(gcols, 1), (h, wd), (kh, kw), dilation=ctx.dilation, padding=ctx.padding,
                 stride=ctx.stride) if gcols else None)
    return gx, (torch.cat(gws, 0) if gws else None)


torch.library.register_autograd("approx::qlinear", _backward_linear, setup_context=_setup_context)
torch.library.register_autograd("approx::qconv2d", _backward_conv2d, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------------------------
# Matmul of two activations (attention's Q.K^T and P.V): approx::qmatmul.
#
# Operand codes. The kernel, approx::lut_bmm, multiplies like lut_linear with y in the weight's place, so x gives
# the table rows (operand A) and y the columns (operand B, always int8). What each operand quantizes to follows
# from the table's signedness and whether the operand's data is signed (matmul_qranges):
#   signed table (mul8s_*): both int8; signed data [-128, 127] (as layer inputs), unsigned data (softmax
#     probabilities) [0, 127]. The table as it is.
#   unsigned table (mul8u_*): the multiplier sees magnitudes, the sign is applied after (sign-magnitude):
#     x unsigned: uint8 [0, 255], the table as it is (the full input range for probabilities).
#     x signed:   int8 [-127, 127] through the derived signed table
#                 T[a + 128][b + 128] = sign(a) * sign(b) * lut[|a|][|b|]   (sign_magnitude_table),
#                 so product = sign(a) sign(b) LUT(|a|, |b|) with sign(0) = 0.
#     y: int8 sign-magnitude as weights are, [-127, 127] when signed, [0, 127] when unsigned.
#   Why magnitudes <= 127 for a signed operand of an unsigned table: its codes stay int8 (sign + 7-bit
#   magnitude, symmetric like the weights), so Q.K^T runs the same one-call signed kernel on the derived
#   table; 255 would need 9-bit codes and a second kernel mode for a gain of one bit. The cost: such an
#   operand uses the lower half of the multiplier's inputs, whose error pattern is what the model sees.
# Scales are per tensor, both dynamic or calibrated by the caller: scale = amax / qmax of the operand's range
# (matmul_scale). The output is float32(acc) * (x_scale * y_scale) (dequantize_matmul): an exact-integer
# fake-quant path that dequantizes the same way matches bit for bit.
# Backward: grad="ste" is fake-quant's gradient (the exact product of the fake-quantized operands, times each
# quantizer's clipping mask); grad="lut" uses the table's slopes (matmul_slope_tables) in the exact products'
# place, along a for x and along b for y, through lut_grad_a / lut_grad_w per batch:
#   dL/dx[i,m,k] = mask_x * s_y * sum_n g[i,m,n] dP/da(a[i,m,k], b[i,n,k])
#   dL/dy[i,n,k] = mask_y * s_x * sum_m g[i,m,n] dP/db(a[i,m,k], b[i,n,k])
# A scale that requires grad gets the LSQ gradient, as qlinear's activation scale does.

def matmul_qranges(lut_signed: bool, x_signed: bool, y_signed: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """((qmin, qmax) of x's codes, (qmin, qmax) of y's codes) for qmatmul (see the comment above)."""
    if lut_signed:
        return ((-128, 127) if x_signed else (0, 127)), ((-128, 127) if y_signed else (0, 127))
    return ((-127, 127) if x_signed else (0, 255)), ((-127, 127) if y_signed else (0, 127))


def matmul_scale(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per-tensor scale of a qmatmul operand with |values| <= amax: amax / qmax (1 for a zero range), rounded
    once as every layer's activation scale is."""
    from runner.quant import true_divide

    amax = amax.detach().float().reshape(())
    return torch.where(amax > 0, true_divide(amax, qmax), torch.ones_like(amax))


def sign_magnitude_table(lut: torch.Tensor) -> torch.Tensor:
    """The signed-code table of an unsigned multiplier used sign-magnitude on both operands:
    T[a + 128][b + 128] = sign(a) * sign(b) * lut[|a|][|b|] for a, b in [-128, 127]."""
    v = torch.arange(-128, 128, device=lut.device)
    mag, sign = v.abs(), torch.sign(v).to(torch.int32)
    return (lut[mag][:, mag] * sign.unsqueeze(1) * sign.unsqueeze(0)).contiguous()


def matmul_table(lut: torch.Tensor, lut_signed: bool, x_signed: bool) -> tuple[torch.Tensor, bool]:
    """(the table lut_bmm runs, whether x's codes are int8) for qmatmul's operands."""
    if not lut_signed and x_signed:
        return sign_magnitude_table(lut), True
    return lut, lut_signed


def matmul_slope_tables(lut: torch.Tensor, lut_signed: bool, x_signed: bool, window: int = 1):
    """(slope_x, slope_y) for qmatmul(grad="lut"): the slopes of the table qmatmul runs, along a and along b,
    indexed as lut_grad_a / lut_grad_w take them. Compute once per table, like a layer's slope_tables."""
    from runner.lut_slopes import slope_tables

    table, a_int8 = matmul_table(lut, lut_signed, x_signed)
    return slope_tables(table, a_int8, window)


def _matmul_codes(t, scale, qrange, int8, backend):
    """Codes of one operand: quantize's codes (int8 or uint8), clamped into the operand's narrower range."""
    codes = quantize(t.contiguous(), scale, int8, backend=backend)
    full = (-128, 127) if int8 else (0, 255)
    return codes if tuple(qrange) == full else codes.clamp_(*qrange)


def dequantize_matmul(acc: torch.Tensor, x_scale: torch.Tensor, y_scale: torch.Tensor) -> torch.Tensor:
    """float32 acc * (x_scale * y_scale): qmatmul's output from its int32 accumulators."""
    return acc.to(torch.float32) * (x_scale * y_scale)


def _flat3(t):
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def qforward_matmul(x, y, x_scale, y_scale, lut, lut_signed, x_signed, y_signed, backend):
    table, a_int8 = matmul_table(lut, lut_signed, x_signed)
    xr, yr = matmul_qranges(lut_signed, x_signed, y_signed)
    a = _matmul_codes(_flat3(x), x_scale, xr, a_int8, backend)
    b = _matmul_codes(_flat3(y), y_scale, yr, True, backend)
    acc = lut_bmm(a, b, table, backend=backend)
    return dequantize_matmul(acc, x_scale, y_scale).reshape(*x.shape[:-1], y.shape[-2])


@torch.library.custom_op("approx::qmatmul", mutates_args=())
def _qmatmul(x: torch.Tensor, y: torch.Tensor, x_scale: torch.Tensor, y_scale: torch.Tensor, lut: torch.Tensor,
             slope_x: torch.Tensor, slope_y: torch.Tensor, lut_signed: bool, x_signed: bool, y_signed: bool,
             backend: str, grad: str) -> torch.Tensor:
    return qforward_matmul(x, y, x_scale, y_scale, lut, lut_signed, x_signed, y_signed, backend)


@_qmatmul.register_fake
def _(x, y, x_scale, y_scale, lut, slope_x, slope_y, lut_signed, x_signed, y_signed, backend, grad):
    torch._check(x.dim() >= 2 and x.shape[:-2] == y.shape[:-2] and x.shape[-1] == y.shape[-1],
                 lambda: "qmatmul: expected x [..., M, K] and y [..., N, K] with the same leading dims")
    return x.new_empty((*x.shape[:-1], y.shape[-2]))


def qmatmul(x, y, x_scale, y_scale, lut, x_signed, y_signed, backend, grad="ste", slope_x=None, slope_y=None, *,
            lut_signed):
    """approx(x @ y.transpose(-1, -2)) for x float [..., M, K], y float [..., N, K] (the same leading dims, no
    broadcasting): both quantized per tensor at x_scale / y_scale (0-d float32 on their device), multiplied
    through `lut` (the multiplier's raw [256, 256] table; lut_signed: mul8s_* or mul8u_*) with approx::lut_bmm on
    `backend`, dequantized by x_scale * y_scale. x_signed / y_signed: whether the operand's data is signed
    (Q, K, V: True; softmax probabilities: False); matmul_qranges gives each operand's code range for
    calibration (matmul_scale). An unsigned table multiplies signed operands sign-magnitude:
    product = sign(a) * sign(b) * LUT(|a|, |b|) with |a|, |b| <= 127, so codes stay int8 and Q.K^T runs the
    signed kernel on sign_magnitude_table(lut); probabilities (x unsigned) get uint8 codes 0..255 there.
    grad: "ste" (fake-quant's gradient) or "lut" (the table's slopes: pass matmul_slope_tables(lut, lut_signed,
    x_signed) as slope_x, slope_y). Gradients flow to x, y and to a scale that requires grad (LSQ)."""
    check_grad_mode(grad)
    if x.dim() < 2 or x.shape[:-2] != y.shape[:-2] or x.shape[-1] != y.shape[-1]:
        raise RuntimeError(f"qmatmul: expected x [..., M, K] and y [..., N, K] with the same leading dims, got "
                           f"{list(x.shape)} and {list(y.shape)}")
    if grad == "lut" and (slope_x is None or slope_y is None):
        raise RuntimeError("qmatmul: grad='lut' needs slope_x and slope_y (matmul_slope_tables)")
    empty = lut.new_empty((0,), dtype=torch.float32)
    return _qmatmul(x, y, x_scale, y_scale, lut, empty if slope_x is None else slope_x,
                    empty if slope_y is None else slope_y, bool(lut_signed), bool(x_signed), bool(y_signed),
                    backend, grad)


def _setup_matmul(ctx, inputs, output):
    x, y, x_scale, y_scale, lut, slope_x, slope_y = inputs[:7]
    ctx.save_for_backward(x, y, x_scale, y_scale, lut, slope_x, slope_y)
    ctx.lut_signed, ctx.x_signed, ctx.y_signed, ctx.backend, ctx.grad = inputs[7:]


def _backward_matmul(ctx, g):
    x, y, x_scale, y_scale, lut, slope_x, slope_y = ctx.saved_tensors
    need_x, need_y, need_sx, need_sy = ctx.needs_input_grad[:4]
    xr, yr = matmul_qranges(ctx.lut_signed, ctx.x_signed, ctx.y_signed)
    xq, mask_x = _fake_quant_with_mask(x, x_scale, *xr)
    yq, mask_y = _fake_quant_with_mask(y, y_scale, *yr)
    g = g.to(torch.float32)
    gxq = gyq = None
    if ctx.grad == "ste":
        if need_x or need_sx:
            gxq = torch.matmul(g, yq)
        if need_y or need_sy:
            gyq = torch.matmul(g.transpose(-1, -2), xq)
    else:
        _, a_int8 = matmul_table(lut, ctx.lut_signed, ctx.x_signed)
        a = _flat3(torch.round(xq / x_scale).to(torch.int8 if a_int8 else torch.uint8))
        b = _flat3(torch.round(yq / y_scale).to(torch.int8))
        g3 = _flat3(g)
        # per batch through the rows-form kernels (no batched lut_grad op yet)
        if need_x or need_sx:
            gs = (g3 * y_scale).contiguous()
            gxq = torch.stack([lut_grad_a(a[i], b[i], gs[i], slope_x, backend=ctx.backend)
                               for i in range(a.shape[0])]).reshape(x.shape)
        if need_y or need_sy:
            gyq = torch.stack([lut_grad_w(a[i], b[i], g3[i].contiguous(), slope_y, backend=ctx.backend)
                               for i in range(a.shape[0])]).reshape(y.shape) * x_scale
    gx = gxq * mask_x if need_x else None
    gy = gyq * mask_y if need_y else None
    gsx = _scale_grad(gxq, x, xq, mask_x, x_scale) if need_sx else None
    gsy = _scale_grad(gyq, y, yq, mask_y, y_scale) if need_sy else None
    return gx, gy, gsx, gsy, *([None] * 8)


torch.library.register_autograd("approx::qmatmul", _backward_matmul, setup_context=_setup_matmul)
