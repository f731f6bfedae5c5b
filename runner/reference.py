"""The pure-PyTorch reference of every approx:: kernel: the oracle the compiled kernels are tested against, and
what backend="python" runs (runner.ops dispatches to it). Slow and simple on purpose.

Arithmetic of the LUT MAC (identical for every backend; extensions/csrc/ops.cpp holds the schemas):
  a    activation codes, int8 (signed multiplier) or uint8 (unsigned multiplier)
  w    weight codes, int8
  lut  int32 [256, 256], row = activation operand, column = weight operand
         signed   (a int8):  product = lut[a + 128][w + 128]
         unsigned (a uint8): product = sign(w) * lut[a][|w|]   (sign-magnitude weights: the
                             magnitude goes through the multiplier, the sign is applied after;
                             sign(0) = 0, so w = 0 contributes 0; w = -128 reads column 128)
  out  int32: exact sum of the products, wrapped to int32 like a hardware accumulator.
  Conv padding is activation code 0 fed through the multiplier (lut(0, w) may be non-zero).

The argument checks below raise the messages the kernels raise for the same bad input. The references of the
other ops are defined beside the arithmetic they share and collected here, so this module names every oracle:
quantize / dequantize / requantize in runner.quant, lut_grad_a / lut_grad_w in runner.lut_slopes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.lut_slopes import reference_lut_grad_a, reference_lut_grad_w
from runner.quant import reference_dequantize, reference_quantize, reference_requantize, reference_requantize_codes

__all__ = ["as_pair", "conv_output_size", "reference_lut_linear", "reference_lut_conv2d", "reference_lut_bmm",
           "reference_lut_grad_a",
           "reference_lut_grad_w", "reference_quantize", "reference_dequantize", "reference_requantize",
           "reference_requantize_codes"]

# The reference materialises int64 indices of shape [rows, K, N]; this bounds one chunk (bytes).
_REF_CHUNK_BYTES = 64 << 20


def as_pair(v, name: str) -> tuple[int, int]:
    """A conv argument (stride, padding, dilation) as PyTorch takes it, an int or 1 or 2 ints, as a pair."""
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(x) for x in v)
    if len(v) == 1:
        return (v[0], v[0])
    if len(v) != 2:
        raise RuntimeError(f"lut_conv2d: {name} must be an int or a pair, got {v}")
    return v


def conv_output_size(h, w, kh, kw, stride, padding, dilation):
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return ho, wo


def _check_common(op, a, w, lut):
    if a.dtype not in (torch.int8, torch.uint8):
        raise RuntimeError(f"{op}: activation codes `a` must be int8 (signed multiplier) or uint8 "
                           f"(unsigned multiplier), got {a.dtype}")
    if w.dtype != torch.int8:
        raise RuntimeError(f"{op}: weight codes `w` must be int8, got {w.dtype}")
    if lut.dtype != torch.int32 or tuple(lut.shape) != (256, 256):
        raise RuntimeError(f"{op}: `lut` must be an int32 tensor of shape [256, 256], "
                           f"got {lut.dtype} {list(lut.shape)}")
    for name, t in (("a", a), ("w", w), ("lut", lut)):
        if not t.is_contiguous():
            raise RuntimeError(f"{op}: `{name}` must be contiguous (call .contiguous() first)")
    if not (a.device == w.device == lut.device):
        raise RuntimeError(f"{op}: a, w and lut must be on the same device, got "
                           f"{a.device}, {w.device}, {lut.device}")


def _check_linear(a, w, lut):
    _check_common("lut_linear", a, w, lut)
    if a.dim() != 2 or w.dim() != 2:
        raise RuntimeError(f"lut_linear: expected a [M, K] and w [N, K], got a {list(a.shape)}, "
                           f"w {list(w.shape)}")
    if a.shape[1] != w.shape[1]:
        raise RuntimeError(f"lut_linear: a has K={a.shape[1]} columns but w has K={w.shape[1]}")


def _check_bmm(a, b, lut):
    """lut_bmm's checks: a's and b's codes follow lut_linear's a and w (b [B, N, K] is a batch of weights)."""
    if a.dtype not in (torch.int8, torch.uint8):
        raise RuntimeError(f"lut_bmm: codes `a` must be int8 (signed multiplier) or uint8 (unsigned multiplier), "
                           f"got {a.dtype}")
    if b.dtype != torch.int8:
        raise RuntimeError(f"lut_bmm: codes `b` must be int8, got {b.dtype}")
    if lut.dtype != torch.int32 or tuple(lut.shape) != (256, 256):
        raise RuntimeError(f"lut_bmm: `lut` must be an int32 tensor of shape [256, 256], "
                           f"got {lut.dtype} {list(lut.shape)}")
    for name, t in (("a", a), ("b", b), ("lut", lut)):
        if not t.is_contiguous():
            raise RuntimeError(f"lut_bmm: `{name}` must be contiguous (call .contiguous() first)")
    if not (a.device == b.device == lut.device):
        raise RuntimeError(f"lut_bmm: a, b and lut must be on the same device, got {a.device}, {b.device}, "
                           f"{lut.device}")
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[2]:
        raise RuntimeError(f"lut_bmm: expected a [B, M, K] and b [B, N, K], got a {list(a.shape)}, "
                           f"b {list(b.shape)}")


def _check_conv(a, w, lut, stride, padding, dilation, groups):
    _check_common("lut_conv2d", a, w, lut)
    if a.dim() != 4 or w.dim() != 4:
        raise RuntimeError(f"lut_conv2d: expected a [B, C, H, W] and w [N, C/groups, kh, kw], got "
                           f"a {list(a.shape)}, w {list(w.shape)}")
    stride, padding, dilation = as_pair(stride, "stride"), as_pair(padding, "padding"), as_pair(dilation, "dilation")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise RuntimeError(f"lut_conv2d: need stride >= 1, dilation >= 1, padding >= 0, got "
                           f"stride {stride}, padding {padding}, dilation {dilation}")
    if groups < 1 or a.shape[1] % groups or w.shape[0] % groups:
        raise RuntimeError(f"lut_conv2d: groups={groups} must divide input channels ({a.shape[1]}) "
                           f"and output channels ({w.shape[0]})")
    if w.shape[1] * groups != a.shape[1]:
        raise RuntimeError(f"lut_conv2d: w expects {w.shape[1] * groups} input channels "
                           f"({w.shape[1]} per group x {groups} groups), a has {a.shape[1]}")
    ho, wo = conv_output_size(a.shape[2], a.shape[3], w.shape[2], w.shape[3], stride, padding, dilation)
    if ho < 1 or wo < 1:
        raise RuntimeError(f"lut_conv2d: output would be empty ({ho}x{wo}) for input "
                           f"{list(a.shape[2:])}, kernel {list(w.shape[2:])}")
    return stride, padding, dilation, ho, wo


def _wrap_int32(s):
    """int64 sums -> int32 with two's-complement wrap (what an int32 accumulator does)."""
    return ((s + 2**31) % 2**32 - 2**31).to(torch.int32)


def _weight_index(w, signed):
    """Flat column index into the LUT row and the sign to apply, both [K, N] from w [N, K]."""
    w64 = w.to(torch.int64).t()
    if signed:
        return w64 + 128, None
    return w64.abs(), torch.sign(w64)


def _linear_codes(a, w, lut):
    """a [M, K] int8/uint8, w [N, K] int8 -> int32 [M, N]; assumes validated inputs."""
    signed = a.dtype == torch.int8
    m, k = a.shape
    n = w.shape[0]
    col, sign = _weight_index(w, signed)
    flat = lut.reshape(-1)
    out = torch.empty((m, n), dtype=torch.int32, device=a.device)
    rows = max(1, _REF_CHUNK_BYTES // (8 * max(1, k * n)))
    for s in range(0, m, rows):
        ai = a[s:s + rows].to(torch.int64)
        if signed:
            ai = ai + 128
        prod = flat[(ai * 256).unsqueeze(2) + col.unsqueeze(0)]  # [m, K, N] int32
        if sign is not None:
            prod = prod.to(torch.int64) * sign
        out[s:s + rows] = _wrap_int32(prod.sum(dim=1, dtype=torch.int64))
    return out


def reference_lut_linear(a, w, lut):
    """int32 [M, N] = sum_k product(a[m, k], w[n, k]) through the multiplier LUT (approx::lut_linear, any algo:
    every variant computes these sums)."""
    _check_linear(a, w, lut)
    return _linear_codes(a, w, lut)


def reference_lut_bmm(a, b, lut):
    """int32 [B, M, N] = sum_k product(a[i, m, k], b[i, n, k]) through the LUT (approx::lut_bmm): lut_linear of
    each batch, b[i] in the weight's place. Computed over all batches at once (rows of every batch in one
    gather), so the tests' comparison with per-batch lut_linear checks the batch indexing too."""
    _check_bmm(a, b, lut)
    nb, m, k = a.shape
    n = b.shape[1]
    signed = a.dtype == torch.int8
    b64 = b.to(torch.int64).transpose(1, 2)                     # [B, K, N]
    col, sign = (b64 + 128, None) if signed else (b64.abs(), torch.sign(b64))
    rows_a = a.reshape(nb * m, k).to(torch.int64) + (128 if signed else 0)
    flat = lut.reshape(-1)
    out = torch.empty((nb * m, n), dtype=torch.int32, device=a.device)
    step = max(1, _REF_CHUNK_BYTES // (8 * max(1, k * n)))
    for s in range(0, nb * m, step):
        batch = torch.arange(s, min(s + step, nb * m), device=a.device) // max(1, m)
        prod = flat[(rows_a[s:s + step] * 256).unsqueeze(2) + col[batch]]   # [rows, K, N]
        if sign is not None:
            prod = prod.to(torch.int64) * sign[batch]
        out[s:s + step] = _wrap_int32(prod.sum(dim=1, dtype=torch.int64))
    return out.reshape(nb, m, n)


def reference_lut_conv2d(a, w, lut, stride=1, padding=0, dilation=1, groups=1):
    """int32 [B, N, Ho, Wo] conv2d of codes through the LUT (approx::lut_conv2d, any algo)."""
    stride, padding, dilation, ho, wo = _check_conv(a, w, lut, stride, padding, dilation, groups)
    b, c, h, wd = a.shape
    n, cg, kh, kw = w.shape
    ng = n // groups
    kg = cg * kh * kw
    out = torch.empty((b, n, ho, wo), dtype=torch.int32, device=a.device)
    # unfold needs floats; codes (-128..255) are exact in float32 and padding becomes code 0.
    imgs = max(1, _REF_CHUNK_BYTES // (4 * c * kh * kw * ho * wo))
    for s in range(0, b, imgs):
        cols = F.unfold(a[s:s + imgs].to(torch.float32), (kh, kw), dilation=dilation,
                        padding=padding, stride=stride)  # [bb, C*kh*kw, L], channel-major per group
        bb = cols.shape[0]
        cols = cols.to(a.dtype)
        for g in range(groups):
            rows = cols[:, g * kg:(g + 1) * kg, :].transpose(1, 2).reshape(-1, kg).contiguous()
            wg = w[g * ng:(g + 1) * ng].reshape(ng, kg)
            res = _linear_codes(rows, wg, lut)  # [bb*L, ng]
            out[s:s + bb, g * ng:(g + 1) * ng] = res.reshape(bb, ho * wo, ng).transpose(1, 2).reshape(
                bb, ng, ho, wo)
    return out
