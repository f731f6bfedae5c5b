"""The attention products quantized: both operands of a MatMul (a @ b^T) to 8-bit codes at per-tensor scales from
calibration, multiplied exactly (FakeQuantMatMul) or through the multiplier's table (ApproxMatMul, the op
approx::qmatmul of runner.ops_autograd, which says how each operand's codes follow from the table's signedness
and the data's: Q, K and V signed, softmax probabilities unsigned).

At inference the fake-quant twin sums the exact products of the same codes in float64 (exact integers) and
dequantizes as qmatmul does (float32(acc) * (s_a * s_b)), so with an exact table the two give the same bits.
The operands' signedness comes from calibration (an operand whose minimum is >= 0 is unsigned)."""
from __future__ import annotations

import torch
from torch import nn

from runner.layer_checks import check_accumulator, check_finite
from runner.ops_autograd import (check_grad_mode, dequantize_matmul, matmul_qranges, matmul_scale,
                                 matmul_slope_tables, qmatmul)
from runner.quant import ActStats, QuantConfig, dynamic_amax


def _codes(t: torch.Tensor, scale: torch.Tensor, qrange: tuple[int, int]) -> torch.Tensor:
    """The integers qmatmul's operand codes hold (torch's fake-quantize grid at this scale and range)."""
    zero = torch.zeros((), dtype=torch.int32, device=t.device)
    fq = torch.fake_quantize_per_tensor_affine(t, scale.to(t.device), zero, *qrange)
    return torch.round(fq / scale.to(t.device))


class QuantizedMatMul(nn.Module):
    """State shared by the two variants. Has the quantized layers' interface (runner.layers._Quantized) where it
    applies; the weight-side methods do nothing (no weights)."""

    requant = "float"  # the product's output goes to softmax or a reshape in float: no integer hand-over

    def __init__(self, signed: bool, qcfg: QuantConfig, stats: ActStats | None, name: str = "?"):
        super().__init__()
        self.layer_name = name
        self.signed = bool(signed)  # the table's signedness
        self.dynamic = qcfg.activation == "dynamic"
        self.register_buffer("nonfinite_input", torch.zeros(1, dtype=torch.bool), persistent=False)
        self.x_signed = True if stats is None else stats.min < 0
        self.y_signed = True if stats is None or stats.other is None else stats.other.min < 0
        self.register_buffer("act_scale", torch.ones(()))
        self.register_buffer("other_scale", torch.ones(()))
        if stats is not None:
            self.set_act_amax(stats)

    def _qranges(self):
        return matmul_qranges(self.signed, self.x_signed, self.y_signed)

    @staticmethod
    def _amax(stats: ActStats, signed_data: bool) -> torch.Tensor:
        return torch.tensor(stats.amax_signed if signed_data else stats.amax_unsigned)

    @torch.no_grad()
    def set_act_amax(self, stats: ActStats) -> None:
        xr, yr = self._qranges()
        self.act_scale.copy_(matmul_scale(self._amax(stats, self.x_signed), xr[1]))
        if stats.other is not None:
            self.other_scale.copy_(matmul_scale(self._amax(stats.other, self.y_signed), yr[1]))

    def scales(self, a, b):
        if not self.dynamic:
            return self.act_scale, self.other_scale
        xr, yr = self._qranges()
        return (matmul_scale(dynamic_amax(a, self.x_signed), xr[1]).to(a.device),
                matmul_scale(dynamic_amax(b, self.y_signed), yr[1]).to(b.device))

    def _check(self, a, b):
        if not a.is_cuda:  # on a GPU a NaN becomes some code (the kernels' flags cover the weight layers only)
            check_finite(self.layer_name, "the first operand", a.detach())
            check_finite(self.layer_name, "the second operand", b.detach())

    # the weight-side interface of runner.layers._Quantized: nothing to do without weights
    def refresh_weight_quant(self) -> None:
        pass

    def set_weight_scale_factor(self, factor: float) -> None:
        pass

    def learn_act_scale(self, on: bool = True) -> None:
        """The products' scales stay as calibrated (recalibration updates them); not learned."""

    def input_scale(self, x):
        return self.act_scale

    def _code_consumer(self):
        return None

    def extra_repr(self):
        return f"signed={self.signed}, x_signed={self.x_signed}, y_signed={self.y_signed}"


class FakeQuantMatMul(QuantizedMatMul):
    def forward(self, a, b):
        self._check(a, b)
        sa, sb = self.scales(a, b)
        xr, yr = self._qranges()
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):  # training: torch's fake-quant STE
            zero = torch.zeros((), dtype=torch.int32, device=a.device)
            fa = torch.fake_quantize_per_tensor_affine(a, sa.to(a.device), zero, *xr)
            fb = torch.fake_quantize_per_tensor_affine(b, sb.to(b.device), zero, *yr)
            return fa @ fb.transpose(-1, -2)
        # the exact products of the codes, summed exactly (float64 holds every such sum), dequantized as qmatmul
        acc = _codes(a, sa, xr).double() @ _codes(b, sb, yr).double().transpose(-1, -2)
        return dequantize_matmul(acc, sa, sb)


class ApproxMatMul(QuantizedMatMul):
    def __init__(self, multiplier, qcfg: QuantConfig, stats: ActStats | None, backend: str = "python",
                 grad: str = "ste", name: str = "?"):
        super().__init__(multiplier.signed, qcfg, stats, name)
        self.multiplier_name, self.backend = multiplier.name, backend
        self.value_bounds = multiplier.value_bounds
        self.register_buffer("lut", multiplier.lut.to(torch.int32).contiguous())
        self.grad, self.slope_window, self._slope_cache = "ste", 1, None
        self.set_grad(grad)

    def set_multiplier(self, multiplier) -> None:
        """Another table of the same signedness (runner.layers._Approx.set_multiplier)."""
        if multiplier.signed != self.signed:
            raise ValueError(f"layer {self.layer_name} is {'un' * (not self.signed)}signed, multiplier "
                             f"{multiplier.name} is not")
        self.lut = multiplier.lut.to(device=self.lut.device, dtype=torch.int32).contiguous()
        self.multiplier_name, self.value_bounds, self._slope_cache = multiplier.name, multiplier.value_bounds, None

    def set_grad(self, grad: str, slope_window: int = 1) -> None:
        check_grad_mode(grad)
        self.grad, self.slope_window, self._slope_cache = grad, int(slope_window), None

    def _slopes(self):
        if self.grad != "lut":
            return None, None
        key = (self.lut.data_ptr(), self.lut._version, self.lut.device)
        if self._slope_cache is None or self._slope_cache[0] != key:
            self._slope_cache = (key, matmul_slope_tables(self.lut, self.signed, self.x_signed, self.slope_window))
        return self._slope_cache[1]

    def forward(self, a, b):
        self._check(a, b)
        check_accumulator(self.layer_name, a.shape[-1], self.value_bounds)
        sa, sb = self.scales(a, b)
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a, b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
        return qmatmul(a, b, sa.to(a.device), sb.to(b.device), self.lut, self.x_signed, self.y_signed, self.backend,
                       self.grad, *self._slopes(), lut_signed=self.signed)

    def extra_repr(self):
        return f"multiplier={self.multiplier_name}, {super().extra_repr()}, backend={self.backend}, grad={self.grad}"
