"""The exact integer convolution the fake-quant layers sum their codes with (runner.layers): any summation
order on any device gives the same integers."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.reference import as_pair, conv_output_size


def exact_dtype(k: int, signed: bool) -> torch.dtype:
    """float32 when every partial sum of k products of 8-bit codes stays below 2^24, so float32 sums are exact
    in any order; float64 (exact below 2^53) otherwise."""
    return torch.float32 if k * (128 if signed else 255) * 127 < 1 << 24 else torch.float64


def exact_conv2d(codes: torch.Tensor, weight_codes: torch.Tensor, stride, padding, dilation, groups,
                 integer: bool = True) -> torch.Tensor:
    """int64 conv2d of integer codes, summed exactly (exact_dtype): any summation order on any device gives
    the same integers (integer=False: the same integers in the float dtype they were summed in, without the
    int64 copy). cuDNN is never used: its FFT and Winograd algorithms transform the operands with
    inexact constants. The CPU's direct / im2col convolutions only add products; on the GPU, whose convolution
    without cuDNN runs one GEMM per image (a fake-quant ResNet-8 took 45x the LUT model's time), it is one
    unfold and a batched matmul (unfold_conv2d)."""
    dtype = exact_dtype(weight_codes[0].numel(), codes.dtype == torch.int8)
    if codes.is_cuda:
        if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
            dtype = torch.float64  # TF32 matmuls round the products' operands: not exact
        acc = unfold_conv2d(codes.to(dtype), weight_codes.to(dtype), stride, padding, dilation, groups)
    else:
        with torch.backends.cudnn.flags(enabled=False):
            acc = F.conv2d(codes.to(dtype), weight_codes.to(dtype), None, stride, padding, dilation, groups)
    return acc.to(torch.int64) if integer else acc


def unfold(x: torch.Tensor, kernel, dilation, padding, stride) -> torch.Tensor:
    """F.unfold(x, ...) ([B, C*kh*kw, Ho*Wo], padding zeros) as one strided copy of the padded input. On a GPU
    F.unfold launches an im2col kernel per image: 512 launches per training step of LeNet-5 at batch 256."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = (as_pair(v, name) for v, name in
                                              ((kernel, "kernel"), (dilation, "dilation"), (padding, "padding"),
                                               (stride, "stride")))
    ho, wo = conv_output_size(x.shape[2], x.shape[3], kh, kw, (sh, sw), (ph, pw), (dh, dw))
    xp = F.pad(x, (pw, pw, ph, ph)).contiguous()
    b, c = xp.shape[:2]
    sb, sc, sy, sx = xp.stride()
    view = xp.as_strided((b, c, kh, kw, ho, wo), (sb, sc, sy * dh, sx * dw, sy * sh, sx * sw))
    return view.reshape(b, c * kh * kw, ho * wo)


def unfold_conv2d(x: torch.Tensor, w: torch.Tensor, stride, padding, dilation, groups: int,
                  max_elements: int = 1 << 27) -> torch.Tensor:
    """conv2d (no bias) as im2col for a slice of the batch at once and one batched matmul per slice; the slices
    keep the unfolded input below max_elements. Only multiplies and adds, so integer-valued operands whose sums
    stay exact in the dtype give the exact integers."""
    stride, padding, dilation = (as_pair(v, name) for v, name in
                                 ((stride, "stride"), (padding, "padding"), (dilation, "dilation")))
    b, n, (kh, kw) = x.shape[0], w.shape[0], w.shape[2:]
    ho, wo = conv_output_size(x.shape[2], x.shape[3], kh, kw, stride, padding, dilation)
    taps = w[0].numel()
    wg = w.reshape(groups, n // groups, taps)
    step = max(1, max_elements // max(1, groups * taps * ho * wo))
    outs = []
    for i in range(0, b, step):
        cols = unfold(x[i:i + step], (kh, kw), dilation, padding, stride)
        cols = cols.reshape(cols.shape[0], groups, taps, ho * wo)  # unfold's rows: channel-major, then taps
        outs.append(torch.matmul(wg, cols).reshape(cols.shape[0], n, ho, wo))
    return torch.cat(outs) if outs else x.new_zeros((0, n, ho, wo))
