"""Pure-PyTorch references of the `lut` gradient (the oracles of approx::lut_grad_a / lut_grad_w) and the
multiplier's slope tables it uses; runner.reference names them with the other references."""
from __future__ import annotations

import torch

_REF_CHUNK_BYTES = 64 << 20  # the references materialise float64 [rows, K, N] products; one chunk's bound


def _check_grad(op, a, w, grad, slope):
    if a.dtype not in (torch.int8, torch.uint8) or w.dtype != torch.int8:
        raise RuntimeError(f"{op}: codes must be a int8/uint8 and w int8, got {a.dtype}, {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise RuntimeError(f"{op}: expected a [M, K] and w [N, K], got {list(a.shape)}, {list(w.shape)}")
    if grad.dtype != torch.float32 or tuple(grad.shape) != (a.shape[0], w.shape[0]):
        raise RuntimeError(f"{op}: grad must be float32 [M, N] = {[a.shape[0], w.shape[0]]}, "
                           f"got {grad.dtype} {list(grad.shape)}")
    if slope.dtype != torch.float32 or tuple(slope.shape) != (256, 256):
        raise RuntimeError(f"{op}: slope must be float32 [256, 256], got {slope.dtype} {list(slope.shape)}")


def _slope_products(a, w, slope, rows):
    """slope[row(a[m, k])][w[n, k] + 128] for rows m in `rows`: float64 [m, K, N]."""
    ai = a[rows].to(torch.int64)
    if a.dtype == torch.int8:
        ai = ai + 128
    col = w.to(torch.int64).t() + 128                       # [K, N]
    return slope.reshape(-1).to(torch.float64)[(ai * 256).unsqueeze(2) + col.unsqueeze(0)]


def reference_lut_grad_a(a, w, grad, slope):
    """float32 [M, K]: out[m, k] = sum_n grad[m, n] * slope[row(a[m, k])][w[n, k] + 128] (float64 sums).

    With slope = dP/da of the effective product table P (see slope_tables) and grad scaled by the
    weight scale, this is the input gradient of a LUT layer that sees the multiplier's error."""
    _check_grad("lut_grad_a", a, w, grad, slope)
    m, k = a.shape
    out = torch.empty((m, k), dtype=torch.float32, device=a.device)
    step = max(1, _REF_CHUNK_BYTES // (8 * max(1, k * w.shape[0])))
    for s in range(0, m, step):
        prod = _slope_products(a, w, slope, slice(s, s + step))
        out[s:s + step] = (prod * grad[s:s + step].to(torch.float64).unsqueeze(1)).sum(2).to(torch.float32)
    return out


def reference_lut_grad_w(a, w, grad, slope):
    """float32 [N, K]: out[n, k] = sum_m grad[m, n] * slope[row(a[m, k])][w[n, k] + 128] (float64 sums)."""
    _check_grad("lut_grad_w", a, w, grad, slope)
    m, k = a.shape
    acc = torch.zeros((k, w.shape[0]), dtype=torch.float64, device=a.device)
    step = max(1, _REF_CHUNK_BYTES // (8 * max(1, k * w.shape[0])))
    for s in range(0, m, step):
        prod = _slope_products(a, w, slope, slice(s, s + step))
        acc += (prod * grad[s:s + step].to(torch.float64).unsqueeze(1)).sum(0)
    return acc.t().contiguous().to(torch.float32)


def effective_products(lut, signed):
    """float64 [256, 256] P[row(a)][w + 128]: the product the layer adds for codes (a, w), the weight's
    sign folded in for unsigned multipliers (P = sign(w) * lut[a][|w|]), so both kinds index alike."""
    lut = lut.to(torch.float64).cpu()
    if signed:
        return lut
    w = torch.arange(-128, 128)
    return lut[:, w.abs()] * torch.sign(w).to(torch.float64)


def _finite_difference(p, dim, window=1):
    """Slope of p along dim: (p[i+h] - p[i-h]) / 2h, the ends of the range clamped to the table (so h = 1 is
    the central difference inside and one-sided at the edges)."""
    i = torch.arange(256)
    hi, lo = (i + window).clamp(max=255), (i - window).clamp(min=0)
    shape = [1, 1]
    shape[dim] = 256
    return (p.index_select(dim, hi) - p.index_select(dim, lo)) / (hi - lo).to(p.dtype).reshape(shape)


def slope_tables(lut, signed, window=1):
    """(dP/da, dP/dw), float32 [256, 256] on lut's device: the multiplier's own finite-difference slopes over
    +-window codes, which the `lut` gradient uses in place of the exact operands. For the exact multiplier
    P = a * w, so they are exactly w and a (any window), and the `lut` gradient equals the straight-through
    one. A wider window averages the steps of a coarse table into a usable slope."""
    p = effective_products(lut, signed)
    return (_finite_difference(p, 0, window).to(torch.float32).to(lut.device),
            _finite_difference(p, 1, window).to(torch.float32).to(lut.device))
