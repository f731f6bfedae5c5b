"""The LUT multiply-accumulate ops on integer codes and the quantize / dequantize / requantize steps around them:
the public wrappers every caller goes through, and the fake (meta) kernels of the compiled ops. The arithmetic,
and the pure-PyTorch reference that defines it, are in runner.reference; the differentiable float-level layer
ops (approx::qlinear, approx::qconv2d, their autograd) in runner.ops_autograd; the `lut` gradient's slope
tables in runner.lut_slopes.

Backends: "python" runs runner.reference (slow, simple: it is the oracle), "cpp" and "cuda" call
torch.ops.approx.* from the compiled extension runner._C (extensions/csrc/ops.cpp holds the schemas).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from runner import _ext
from runner.errors import UserError
from runner.reference import (as_pair, conv_output_size, reference_dequantize, reference_lut_bmm, reference_lut_conv2d,
                              reference_lut_grad_a, reference_lut_grad_w, reference_lut_linear, reference_quantize,
                              reference_requantize, reference_requantize_codes)

BACKENDS = ("python", "cpp", "cuda")
BACKEND_DEVICE = {"cpp": "cpu", "cuda": "cuda"}  # where the compiled backends' tensors live
# The python reference's variants (it computes the same sums for any name a backend accepts). The
# compiled backends list theirs through approx::lut_algos (backend_algos, algo_table): "auto" picks
# among them, "expanded" is the backend's weight-expanded variant for the shape.
PYTHON_ALGOS = ("direct", "expanded")


@functools.cache
def backend_algos(backend: str) -> tuple[str, ...]:
    """The concrete variants `backend` implements (its kernels say, for any shape)."""
    if backend == "python":
        return PYTHON_ALGOS
    dev = BACKEND_DEVICE[backend]
    a, w = torch.zeros((1, 8), dtype=torch.int8, device=dev), torch.zeros((1, 8), dtype=torch.int8, device=dev)
    return tuple(row["algo"] for row in algo_table(a, w, torch.zeros((256, 256), dtype=torch.int32, device=dev),
                                                   backend=backend))


def algo_table(a, w, lut, stride=1, padding=0, dilation=1, groups=1, *, backend="cpp") -> list[dict]:
    """For a call's shapes (a 2-d: lut_linear, 4-d: lut_conv2d), one row per variant of the backend:
    algo, applies, workspace_bytes (device memory its prepared tables take; None where it does not
    apply), note (why it does not apply), auto_pick (True on the variant auto chose for these shapes,
    once it has: CUDA times its candidates on a shape's first call; auto_pick_name holds the exact
    configuration)."""
    _check_backend(backend)
    if backend == "python":
        return [dict(algo=n, applies=True, workspace_bytes=0, note="", auto_pick=False, auto_pick_name="")
                for n in PYTHON_ALGOS]
    op = _compiled("lut_algos", backend, a)
    names, nbytes, notes, pick = op(a, w, lut, *_conv_args(stride, padding, dilation), groups)
    # a configuration of a variant (expanded_rows_r2_c1, expanded_window_c16, expanded_gemm_r8w) belongs to
    # its variant's row: the longest variant name it extends
    base = max((n for n in names if pick == n or pick.startswith(n + "_")), key=len, default=pick)
    return [dict(algo=n, applies=b >= 0, workspace_bytes=b if b >= 0 else None, note=why, auto_pick=n == base,
                 auto_pick_name=pick if n == base else "")
            for n, b, why in zip(names, nbytes, notes)]


def check_algo(backend: str, algo: str) -> None:
    """Config-time check, so a wrong backend.algo is a clear error before any work."""
    valid = ("auto", "expanded", *backend_algos(backend))
    if algo not in dict.fromkeys(valid):
        raise UserError(f"backend.algo={algo!r} is not an algorithm of backend={backend}; "
                        f"choose one of {', '.join(dict.fromkeys(valid))}.")


@functools.cache
def _known_algos() -> tuple[str, ...]:
    """Every name the reference accepts: auto, its own, and those of the backends built here."""
    out = ["auto", *PYTHON_ALGOS]
    for b in ("cpp", "cuda"):
        if _ext.backend_status().get(b) == "available":
            out += backend_algos(b)
    return tuple(dict.fromkeys(out))


def _check_algo_name(op, algo):
    """backend=python accepts every name a kernel accepts (the reference computes the same sums for each), so a
    misspelt algo fails there as it does on the compiled backends."""
    if algo not in _known_algos() and not algo.startswith(("expanded_rows_r", "expanded_window_c")):
        raise RuntimeError(f"{op}: unknown algo '{algo}'; valid: {', '.join(_known_algos())}")


def lut_grad_a(a, w, grad, slope, *, backend="cpp"):
    _check_backend(backend)
    if backend == "python":
        return reference_lut_grad_a(a, w, grad, slope)
    return _compiled("lut_grad_a", backend, a)(a, w, grad, slope)


def lut_grad_w(a, w, grad, slope, *, backend="cpp"):
    _check_backend(backend)
    if backend == "python":
        return reference_lut_grad_w(a, w, grad, slope)
    return _compiled("lut_grad_w", backend, a)(a, w, grad, slope)


def _compiled(op_name, backend, a):
    err = _ext.extension_error()
    if err is not None:
        raise UserError(f"backend={backend} needs the compiled extension: {err}. {_ext.BUILD_HINT}")
    want = "cpu" if backend == "cpp" else "cuda"
    if a.device.type != want:
        raise UserError(f"backend={backend} runs on {want} tensors, got tensors on {a.device}")
    if not hasattr(torch.ops.approx, op_name):  # a build from before the op existed
        raise UserError(f"backend={backend}: the compiled extension has no approx::{op_name} (it predates the op); "
                        f"rebuild it. {_ext.BUILD_HINT}")
    if not _ext.has_kernel(op_name, "CPU" if backend == "cpp" else "CUDA"):
        raise UserError(f"backend={backend}: {_ext.backend_status()[backend]}")
    return getattr(torch.ops.approx, op_name).default


def _check_backend(backend):
    if backend not in BACKENDS:
        raise UserError(f"unknown backend '{backend}'; valid: {', '.join(BACKENDS)}")


def lut_linear(a, w, lut, *, backend="cpp", algo="auto"):
    """int32 [M, N] = sum_k product(a[m, k], w[n, k]) through the multiplier LUT."""
    _check_backend(backend)
    if backend == "python":
        _check_algo_name("lut_linear", algo)
        return reference_lut_linear(a, w, lut)
    return _compiled("lut_linear", backend, a)(a, w, lut, algo)


def lut_bmm(a, b, lut, *, backend="cpp"):
    """int32 [B, M, N] = sum_k product(a[i, m, k], b[i, n, k]) through the multiplier LUT: lut_linear per batch
    with both operands dynamic (a [B, M, K] codes as lut_linear's a, b [B, N, K] int8 codes as its w). One
    kernel per backend, no algo choice: no operand is constant, so no weight-expanded tables pay off."""
    _check_backend(backend)
    if backend == "python":
        return reference_lut_bmm(a, b, lut)
    return _compiled("lut_bmm", backend, a)(a, b, lut)


def lut_bmm_variants():
    """Names of lut_bmm's kernel variants (the CUDA kernel's layouts, approx::lut_bmm_variants): the first four are
    the ones lut_bmm times on a shape's first call, index 0 what it runs inside a CUDA graph capture; () where the
    compiled extension predates them. A benchmarking aid (benchmarks/cuda_attention.py)."""
    if _ext.extension_error() is not None or not hasattr(torch.ops.approx, "lut_bmm_variants"):
        return ()
    return tuple(torch.ops.approx.lut_bmm_variants())


def lut_bmm_variant(a, b, lut, variant, *, backend="cuda"):
    """lut_bmm through one kernel variant, by name or index into lut_bmm_variants(). Every variant computes the
    same sums; the CPU kernel ("cpp") runs every valid one. Unknown names are a UserError here, unknown indices a
    RuntimeError of the op (its check is shared by every backend)."""
    _check_backend(backend)
    if backend == "python":
        raise UserError("lut_bmm_variant selects a compiled kernel: backend=cpp or cuda")
    op = _compiled("lut_bmm_variant", backend, a)
    if isinstance(variant, str):
        names = lut_bmm_variants()
        if variant not in names:
            raise UserError(f"unknown lut_bmm variant '{variant}'; valid: {', '.join(names)}")
        variant = names.index(variant)
    elif isinstance(variant, bool) or not isinstance(variant, int):
        raise UserError(f"lut_bmm variant must be a name or an int index, got {type(variant).__name__}")
    return op(a, b, lut, variant)


def lut_conv2d(a, w, lut, stride=1, padding=0, dilation=1, groups=1, *, backend="cpp", algo="auto"):
    """int32 [B, N, Ho, Wo] conv2d of codes through the multiplier LUT (PyTorch conv shape rules)."""
    _check_backend(backend)
    if backend == "python":
        _check_algo_name("lut_conv2d", algo)
        return reference_lut_conv2d(a, w, lut, stride, padding, dilation, groups)
    return _compiled("lut_conv2d", backend, a)(a, w, lut, *_conv_args(stride, padding, dilation), groups, algo)


def _conv_args(stride, padding, dilation):
    """The convs' geometry as the ops' int[2] arguments."""
    return list(as_pair(stride, "stride")), list(as_pair(padding, "padding")), list(as_pair(dilation, "dilation"))


def conv_out_shape(a_shape, w_shape, stride, padding, dilation) -> tuple[int, int, int, int]:
    """(B, N, Ho, Wo) of a conv of codes a_shape with weights w_shape (lut_conv2d's output)."""
    ho, wo = conv_output_size(a_shape[2], a_shape[3], w_shape[2], w_shape[3], *_conv_args(stride, padding, dilation))
    return a_shape[0], w_shape[0], ho, wo


def mark_non_finite(flag: torch.Tensor, x: torch.Tensor) -> None:
    """Set the 1-element bool `flag` (on x's device, never cleared here) when x holds a NaN or Inf, without a
    host wait: what the quantize kernels do as they read x, for code that has no such kernel."""
    flag.logical_or_(torch.isfinite(x).logical_not_().any())


def quantize(x, scale, signed, *, backend="cpp", nonfinite=None):
    """int8 (signed) / uint8 codes of x at a per-tensor scale (0-d float32 tensor on x's device).
    nonfinite: None, or a 1-element bool tensor on x's device that is set when x holds a NaN or Inf."""
    _check_backend(backend)
    if backend == "python":
        if nonfinite is not None:
            mark_non_finite(nonfinite, x)
        return reference_quantize(x, scale, signed)
    return _compiled("quantize", backend, x)(x.contiguous(), scale.contiguous(), signed, nonfinite)


def dequantize(acc, act_scale, weight_scale, bias, residual=None, relu=False, codes=None, codes_scale=None, *,
               backend="cpp"):
    """fp32 acc * (act_scale * weight_scale[n]) + bias[n], channel dim 1; then + residual and torch.relu where
    given (a residual block's add and ReLU in the same pass). codes (int8 / uint8 of acc's shape), with
    codes_scale: filled with quantize(output, codes_scale)'s codes in the same pass (the next layer's input)."""
    _check_backend(backend)
    if backend == "python":
        return _dequantize_python(acc, act_scale, weight_scale, bias, residual, relu, codes, codes_scale)
    scale = None if codes_scale is None else codes_scale.reshape(()).contiguous()
    return _compiled("dequantize", backend, acc)(acc, act_scale.reshape(()).contiguous(), weight_scale, bias,
                                                 residual, relu, codes, scale)


def _dequantize_python(acc, act_scale, weight_scale, bias, residual, relu, codes, codes_scale):
    if residual is not None and (residual.shape != acc.shape or residual.dtype != torch.float32):
        raise ValueError(f"dequantize: `residual` must be float32 of acc's shape {list(acc.shape)}, got "
                         f"{residual.dtype} {list(residual.shape)}")
    out = reference_dequantize(acc, act_scale, weight_scale, bias, residual, relu)
    if codes is not None:
        codes.copy_(reference_quantize(out, codes_scale, codes.dtype == torch.int8))
    return out


def requantize(acc, bias, multiplier, shift, out_scale, qmin, qmax, *, backend="cpp"):
    """fp32 code * out_scale with code = clamp(round((acc + bias[n]) * M0[n] / 2^shift[n]), qmin, qmax):
    runner.quant.reference_requantize. acc int32 [B, N, ...]; bias, multiplier (M0), shift int32 [N]
    (requant_multiplier's range); out_scale 0-d float32 on acc's device."""
    _check_backend(backend)
    if backend == "python":
        return reference_requantize(acc, bias, multiplier, shift, out_scale, qmin, qmax)
    return _compiled("requantize", backend, acc)(acc, bias, multiplier, shift, out_scale.reshape(()), qmin, qmax)


def requantize_codes(acc, bias, multiplier, shift, qmin, qmax, signed, *, backend="cpp"):
    """requantize's codes themselves, int8 (signed) / uint8: quantize(requantize(...), out_scale) without the
    float tensor between them (a hand-off read by the next layer alone)."""
    _check_backend(backend)
    if backend == "python":
        if not (-128 if signed else 0) <= qmin < qmax <= (127 if signed else 255):
            raise ValueError(f"requantize_codes: qmin {qmin}, qmax {qmax} outside the {'int8' if signed else 'uint8'} "
                             "codes")
        code = reference_requantize_codes(acc, bias, multiplier, shift, qmin, qmax)
        return code.to(torch.int8 if signed else torch.uint8)
    return _compiled("requantize_codes", backend, acc)(acc, bias, multiplier, shift, qmin, qmax, signed)


def lut_conv2d_dequantize(a, w, lut, stride, padding, dilation, groups, act_scale, weight_scale, bias, residual=None,
                          relu=False, codes=None, codes_scale=None, *, backend="cpp", algo="auto"):
    """dequantize(lut_conv2d(a, w, lut, ...), act_scale, weight_scale, bias, residual, relu, codes, codes_scale) in
    one op, the same values bit for bit: on CUDA expanded_window, unsplit expanded_gemm tiles, depthwise_rows and
    depthwise_planes apply the end in their own stores (docs/backends.md), so the int32 sums are neither written nor
    read back."""
    _check_backend(backend)
    if backend == "python":
        acc = lut_conv2d(a, w, lut, stride, padding, dilation, groups, backend=backend, algo=algo)
        return _dequantize_python(acc, act_scale, weight_scale, bias, residual, relu, codes, codes_scale)
    scale = None if codes_scale is None else codes_scale.reshape(()).contiguous()
    return _compiled("lut_conv2d_dequantize", backend, a)(
        a, w, lut, *_conv_args(stride, padding, dilation), groups, algo, act_scale.reshape(()).contiguous(),
        weight_scale, bias, residual, relu, codes, scale)


def lut_conv2d_requantize_codes(a, w, lut, stride, padding, dilation, groups, bias, multiplier, shift, qmin, qmax,
                                signed, *, backend="cpp", algo="auto"):
    """requantize_codes(lut_conv2d(a, w, lut, ...), ...) in one op (as lut_conv2d_dequantize): a hand-off's codes."""
    _check_backend(backend)
    if backend == "python":
        acc = lut_conv2d(a, w, lut, stride, padding, dilation, groups, backend=backend, algo=algo)
        return requantize_codes(acc, bias, multiplier, shift, qmin, qmax, signed, backend=backend)
    return _compiled("lut_conv2d_requantize_codes", backend, a)(
        a, w, lut, *_conv_args(stride, padding, dilation), groups, algo, bias, multiplier, shift, qmin, qmax, signed)


@dataclass(frozen=True)
class LayerEnd:
    """What a layer's last pass does after its dequantize: add a residual block's shortcut (residual: float, the
    output's shape) and apply its ReLU (relu), and fill `codes` (int8 / uint8, the output's shape) with the output's
    codes at codes_scale: the next layer's input, beside the float output its other readers take."""
    residual: torch.Tensor | None = None
    relu: bool = False
    codes: torch.Tensor | None = None
    codes_scale: torch.Tensor | None = None

    def fits(self, acc: torch.Tensor) -> bool:
        """dequantize takes it as it is (else finish computes it in torch ops: a broadcast residual)."""
        return self.fits_shape(acc.shape)

    def fits_shape(self, shape) -> bool:
        """fits() for sums of this shape."""
        return (self.residual is None or (self.residual.shape == shape and self.residual.dtype == torch.float32)) \
            and (self.codes is None or self.codes.shape == shape)


def finish(acc, act_scale, weight_scale, bias, requant=None, *, backend="cpp", end: LayerEnd | None = None):
    """A layer's last step: dequantize (requant None) or requantize to the next layer's codes (requant: the
    arguments of requantize after acc); then `end` (LayerEnd), in dequantize's pass where it fits."""
    if requant is None and (end is None or end.fits(acc)):
        e = end or LayerEnd()
        return dequantize(acc, act_scale, weight_scale, bias, e.residual, e.relu, e.codes, e.codes_scale,
                          backend=backend)
    out = requantize(acc, *requant, backend=backend) if requant is not None else \
        dequantize(acc, act_scale, weight_scale, bias, backend=backend)
    return out if end is None else apply_end(out, end, backend)


def apply_end(out, end: LayerEnd, backend: str):
    """`end` applied in torch ops to a layer's float output: what dequantize's pass computes where it fits."""
    out = block_end(out, end.residual, end.relu)
    if end.codes is not None:
        end.codes.copy_(quantize(out.contiguous(), end.codes_scale, end.codes.dtype == torch.int8,
                                 backend=backend).reshape(end.codes.shape))
    return out


def block_end(out, residual, relu: bool):
    """out + residual (where given), then torch.relu with relu: a residual block's end as its forward computes it,
    and what dequantize's residual and relu compute in its pass."""
    out = out if residual is None else out + residual
    return torch.relu(out) if relu else out


def _register_fakes():
    """Shape functions for torch.compile / FakeTensor tracing; only once runner._C defined the ops."""
    if _ext.extension_error() is not None:
        return
    if getattr(_register_fakes, "done", False):
        return

    @torch.library.register_fake("approx::lut_linear")
    def _(a, w, lut, algo="auto"):
        torch._check(a.dim() == 2 and w.dim() == 2, lambda: "lut_linear: expected a [M, K], w [N, K]")
        torch._check(a.shape[1] == w.shape[1], lambda: "lut_linear: K of a and w differ")
        return a.new_empty((a.shape[0], w.shape[0]), dtype=torch.int32)

    def conv_shape(a, w, stride, padding, dilation):
        torch._check(a.dim() == 4 and w.dim() == 4, lambda: "lut_conv2d: expected 4-d a and w")
        return conv_out_shape(a.shape, w.shape, stride, padding, dilation)

    @torch.library.register_fake("approx::lut_conv2d")
    def _(a, w, lut, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, algo="auto"):
        return a.new_empty(conv_shape(a, w, stride, padding, dilation), dtype=torch.int32)

    @torch.library.register_fake("approx::quantize")
    def _(x, scale, signed, nonfinite=None):
        return torch.empty_like(x, dtype=torch.int8 if signed else torch.uint8)

    @torch.library.register_fake("approx::dequantize")
    def _(acc, act_scale, weight_scale, bias, residual=None, relu=False, codes=None, codes_scale=None):
        torch._check(acc.dim() >= 2, lambda: "dequantize: acc must be [B, N, ...]")
        return torch.empty_like(acc, dtype=torch.float32)

    def requantize_fake(acc, bias, multiplier, shift, out_scale, qmin, qmax):
        torch._check(acc.dim() >= 2, lambda: "requantize: acc must be [B, N, ...]")
        return torch.empty_like(acc, dtype=torch.float32)

    # an extension built before requantize existed still imports; backend=cpp/cuda then says to rebuild
    if hasattr(torch.ops.approx, "requantize"):
        torch.library.register_fake("approx::requantize")(requantize_fake)

    if hasattr(torch.ops.approx, "requantize_codes"):
        @torch.library.register_fake("approx::requantize_codes")
        def _(acc, bias, multiplier, shift, qmin, qmax, signed):
            torch._check(acc.dim() >= 2, lambda: "requantize_codes: acc must be [B, N, ...]")
            return torch.empty_like(acc, dtype=torch.int8 if signed else torch.uint8)

    if hasattr(torch.ops.approx, "lut_conv2d_dequantize"):  # an older build: backend=cpp/cuda says to rebuild
        @torch.library.register_fake("approx::lut_conv2d_dequantize")
        def _(a, w, lut, stride, padding, dilation, groups, algo, act_scale, weight_scale, bias, residual=None,
              relu=False, codes=None, codes_scale=None):
            return a.new_empty(conv_shape(a, w, stride, padding, dilation), dtype=torch.float32)

        @torch.library.register_fake("approx::lut_conv2d_requantize_codes")
        def _(a, w, lut, stride, padding, dilation, groups, algo, bias, multiplier, shift, qmin, qmax, signed):
            return a.new_empty(conv_shape(a, w, stride, padding, dilation),
                               dtype=torch.int8 if signed else torch.uint8)

    def lut_bmm_fake(a, b, lut):
        torch._check(a.dim() == 3 and b.dim() == 3, lambda: "lut_bmm: expected a [B, M, K], b [B, N, K]")
        torch._check(a.shape[0] == b.shape[0] and a.shape[2] == b.shape[2],
                     lambda: "lut_bmm: B or K of a and b differ")
        return a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=torch.int32)

    if hasattr(torch.ops.approx, "lut_bmm"):  # an older build: backend=cpp/cuda says to rebuild
        torch.library.register_fake("approx::lut_bmm")(lut_bmm_fake)
    if hasattr(torch.ops.approx, "lut_bmm_variant"):
        torch.library.register_fake("approx::lut_bmm_variant")(lambda a, b, lut, variant: lut_bmm_fake(a, b, lut))

    @torch.library.register_fake("approx::lut_grad_a")
    def _(a, w, grad, slope):
        return grad.new_empty((a.shape[0], a.shape[1]))

    @torch.library.register_fake("approx::lut_grad_w")
    def _(a, w, grad, slope):
        return grad.new_empty((w.shape[0], w.shape[1]))

    _register_fakes.done = True


_register_fakes()
