"""torchvision's Swin window attention (V1 and V2) with its qkv and proj Linear layers called as modules and its
products as MatMul modules (runner.attention.explicit_attention). torchvision passes qkv.weight and proj.weight to
a function, so neither Linear is ever called. The steps are torchvision's shifted_window_attention in the same
order; the relative position bias, the shift mask, softmax and V2's cosine scaling stay in float (the softmax an
nn.Softmax module, which a converted model computes in float64: runner.float64_steps)."""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention.matmul import MatMul


def _shift_mask(x, pad_h, pad_w, window, shift, num_windows):
    """[num_windows, Ws*Ws, Ws*Ws] additive mask keeping attention inside each region of a shifted window."""
    mask = x.new_zeros((pad_h, pad_w))
    h_slices = ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None))
    w_slices = ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None))
    for count, (hs, ws) in enumerate((hs, ws) for hs in h_slices for ws in w_slices):
        mask[hs[0]:hs[1], ws[0]:ws[1]] = count
    mask = mask.view(pad_h // window[0], window[0], pad_w // window[1], window[1])
    mask = mask.permute(0, 2, 1, 3).reshape(num_windows, window[0] * window[1])
    mask = mask.unsqueeze(1) - mask.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)


class ExplicitSwin:
    """Mixed into a copy of a torchvision ShiftedWindowAttention(V2) (its parameters and buffers unchanged)."""

    def _add_products(self):
        self.qk, self.av = MatMul(), MatMul()
        self.softmax = nn.Softmax(dim=-1)
        v2 = getattr(self, "logit_scale", None) is not None
        if v2 and self.qkv.bias is not None:
            # V2 never uses the key's bias (torchvision zeroes a copy each call): zero it so the module call agrees
            n = self.qkv.bias.numel() // 3
            with torch.no_grad():
                self.qkv.bias[n:2 * n].zero_()

    def forward(self, x):
        window, heads = self.window_size, self.num_heads
        b, h, w, c = x.shape
        pad_r, pad_b = (window[1] - w % window[1]) % window[1], (window[0] - h % window[0]) % window[0]
        x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        _, pad_h, pad_w, _ = x.shape
        shift = [0 if window[0] >= pad_h else self.shift_size[0], 0 if window[1] >= pad_w else self.shift_size[1]]
        if sum(shift) > 0:
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        nw = (pad_h // window[0]) * (pad_w // window[1])
        x = x.view(b, pad_h // window[0], window[0], pad_w // window[1], window[1], c)
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(b * nw, window[0] * window[1], c)
        n = x.size(1)
        qkv = self.qkv(x).reshape(x.size(0), n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        logit_scale = getattr(self, "logit_scale", None)
        if logit_scale is not None:  # V2's cosine attention
            attn = self.qk(F.normalize(q, dim=-1), F.normalize(k, dim=-1))
            attn = attn * torch.clamp(logit_scale, max=math.log(100.0)).exp()
        else:
            attn = self.qk(q * (c // heads) ** -0.5, k)
        attn = attn + self.get_relative_position_bias()
        if sum(shift) > 0:
            mask = _shift_mask(x, pad_h, pad_w, window, shift, nw)
            attn = attn.view(x.size(0) // nw, nw, heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, heads, n, n)
        attn = F.dropout(self.softmax(attn), p=self.attention_dropout, training=self.training)
        x = self.av(attn, v.transpose(-1, -2)).transpose(1, 2).reshape(x.size(0), n, c)
        x = F.dropout(self.proj(x), p=self.dropout, training=self.training)
        x = x.view(b, pad_h // window[0], pad_w // window[1], window[0], window[1], c)
        x = x.permute(0, 1, 3, 2, 4, 5).reshape(b, pad_h, pad_w, c)
        if sum(shift) > 0:
            x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
        return x[:, :h, :w, :].contiguous()


def explicit_swin(module):
    """The module itself, its class swapped for its explicit twin (parameters and buffers as they were)."""
    from torchvision.models.swin_transformer import ShiftedWindowAttentionV2

    v2 = isinstance(module, ShiftedWindowAttentionV2)
    module.__class__ = _twin("ExplicitWindowAttentionV2" if v2 else "ExplicitWindowAttention")
    module._add_products()
    return module


def swin_classes() -> tuple[type, ...]:
    """torchvision's window attention classes, where torchvision's Swin module is loaded (a model holding one has
    loaded it): importing torchvision for every other model would add its import, a second or more on a small
    CPU, to every command."""
    module = sys.modules.get("torchvision.models.swin_transformer")
    return () if module is None else (module.ShiftedWindowAttention,)


_TWINS: dict[str, type] = {}


def _twin(name: str) -> type:
    """The explicit twin of torchvision's class, made once, under a name of this module: a pickled converted model
    finds it again (module __getattr__ below)."""
    if name not in _TWINS:
        from torchvision.models import swin_transformer as tv

        base = tv.ShiftedWindowAttentionV2 if name.endswith("V2") else tv.ShiftedWindowAttention
        _TWINS[name] = type(name, (ExplicitSwin, base), {"__module__": __name__, "__qualname__": name})
    return _TWINS[name]


def __getattr__(name: str):
    if name in ("ExplicitWindowAttention", "ExplicitWindowAttentionV2"):
        return _twin(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
