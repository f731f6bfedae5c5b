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
    if codes.is_cuda and int_mm_fits(codes, weight_codes, groups):
        acc = int_mm_conv2d(codes, weight_codes, stride, padding, dilation)
        return acc.to(torch.int64) if integer else acc.to(dtype, memory_format=torch.contiguous_format)
    if codes.is_cuda:
        if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
            dtype = torch.float64  # TF32 matmuls round the products' operands: not exact
        acc = unfold_conv2d(codes.to(dtype), weight_codes.to(dtype), stride, padding, dilation, groups)
    else:
        with torch.backends.cudnn.flags(enabled=False):
            acc = F.conv2d(codes.to(dtype), weight_codes.to(dtype), None, stride, padding, dilation, groups)
    return acc.to(torch.int64) if integer else acc


def exact_linear(codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """[M, N] sums of codes [M, K] times weight_codes [N, K], exact, in the float dtype they are exact in
    (exact_dtype); on a GPU through the integer GEMM where it fits."""
    dtype = exact_dtype(codes.shape[-1], codes.dtype == torch.int8)
    if codes.is_cuda and int_mm_fits(codes, weight_codes):
        return int_mm(codes, weight_codes).to(dtype)
    return codes.to(dtype) @ weight_codes.to(dtype).t()


def windows(x: torch.Tensor, kernel, dilation, padding, stride) -> torch.Tensor:
    """[B, C, kh, kw, Ho, Wo]: every kernel window of x (padding zeros) as a strided view of the padded input,
    nothing copied yet."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = (as_pair(v, name) for v, name in
                                              ((kernel, "kernel"), (dilation, "dilation"), (padding, "padding"),
                                               (stride, "stride")))
    ho, wo = conv_output_size(x.shape[2], x.shape[3], kh, kw, (sh, sw), (ph, pw), (dh, dw))
    xp = (F.pad(x, (pw, pw, ph, ph)) if ph or pw else x).contiguous()
    b, c = xp.shape[:2]
    sb, sc, sy, sx = xp.stride()
    return xp.as_strided((b, c, kh, kw, ho, wo), (sb, sc, sy * dh, sx * dw, sy * sh, sx * sw))


def unfold(x: torch.Tensor, kernel, dilation, padding, stride) -> torch.Tensor:
    """F.unfold(x, ...) ([B, C*kh*kw, Ho*Wo], padding zeros) as one strided copy of the padded input. On a GPU
    F.unfold launches an im2col kernel per image: 512 launches per training step of LeNet-5 at batch 256."""
    view = windows(x, kernel, dilation, padding, stride)
    b, c, kh, kw, ho, wo = view.shape
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


# int32 sums of K products of an int8 (or code - 128) and an int8 weight code, plus the unsigned codes'
# correction 128 * sum(w), stay below 2^31 for K below 2^31 / (255 * 128)
INT_MM_MAX_K = (1 << 31) // (255 * 128)


def int_mm_fits(codes: torch.Tensor, weight_codes: torch.Tensor, groups: int = 1) -> bool:
    """Whether int_mm_conv2d / int_mm compute this call: 8-bit codes, int8 weights, one group, K taps whose int32
    sums cannot overflow."""
    return groups == 1 and codes.dtype in (torch.int8, torch.uint8) and weight_codes.dtype == torch.int8 \
        and weight_codes[0].numel() <= INT_MM_MAX_K


def int_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = a [M, K] (int8 or uint8 codes) times w [N, K] (int8) transposed, through the integer matrix
    multiply (torch._int_mm: cuBLASLt's int8 tensor-core GEMM on a GPU), exact: integers with int32 accumulators
    that cannot overflow (int_mm_fits). Unsigned codes go in as code - 128 (their top bit flipped, read as
    int8) and 128 * sum(w) is added back. The GPU kernel wants more than 16 rows and K, N multiples of 8: zero
    rows and taps pad them (zero weights add nothing, whatever the padded codes)."""
    m, k = a.shape
    n = w.shape[0]
    unsigned = a.dtype == torch.uint8
    if unsigned:
        a = a.bitwise_xor(128).view(torch.int8)
    kp, np_, mp = -k % 8, -n % 8, max(0, 17 - m)
    if kp or mp:
        a = F.pad(a, (0, kp, 0, mp))
    if kp or np_:
        w = F.pad(w, (0, kp, 0, np_))
    acc = torch._int_mm(a.contiguous(), w.t())
    if mp or np_:
        acc = acc[:m, :n]
    if unsigned:
        acc = acc + 128 * w[:n].sum(1, dtype=torch.int32)
    return acc


def int_mm_conv2d(codes: torch.Tensor, weight_codes: torch.Tensor, stride, padding, dilation,
                  max_elements: int = 1 << 27) -> torch.Tensor:
    """int32 conv2d (one group) of 8-bit codes as rows of taps (channels-last im2col in the codes' own byte, an
    eighth of float64's traffic) and int_mm, a slice of the batch at a time so the copied taps stay below
    max_elements. Padding taps read code 0, as every other path's."""
    view = windows(codes, tuple(weight_codes.shape[2:]), dilation, padding, stride)  # [B, C, kh, kw, Ho, Wo]
    b, ho, wo = view.shape[0], view.shape[4], view.shape[5]
    n, taps = weight_codes.shape[0], weight_codes[0].numel()
    w = weight_codes.reshape(n, taps)
    step = max(1, max_elements // max(1, taps * ho * wo))
    outs = []
    for i in range(0, b, step):
        part = view[i:i + step]
        acc = int_mm(part.permute(0, 4, 5, 1, 2, 3).reshape(-1, taps), w)  # a row per output pixel, taps in w's order
        outs.append(acc.view(part.shape[0], ho, wo, n).permute(0, 3, 1, 2))
    return torch.cat(outs) if outs else codes.new_zeros((0, n, ho, wo), dtype=torch.int32)
