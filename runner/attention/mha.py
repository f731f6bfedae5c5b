"""nn.MultiheadAttention rewritten with explicit projections and products (runner.attention.explicit_attention).

torch's module passes its packed in_proj_weight and out_proj.weight to F.multi_head_attention_forward, so no
Linear is ever called and the products Q.K^T and P.V happen inside that function: a conversion would see none
of them. Attention computes the same (up to float rounding) with q_proj, k_proj, v_proj and out_proj called as
Linear modules and the products as MatMul modules qk and av; softmax, masks and the scaling stay in float (the
softmax an nn.Softmax module, which a converted model computes in float64: runner.float64_steps)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner.attention.matmul import MatMul
from runner.errors import UserError


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


class Attention(nn.Module):
    """nn.MultiheadAttention's forward (the same arguments and outputs) in explicit steps."""

    def __init__(self, mha: nn.MultiheadAttention, name: str = "?"):
        super().__init__()
        if mha.bias_k is not None or mha.add_zero_attn:
            raise UserError(f"{name}: nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported; "
                            "build it without them, or leave the model's attention unconverted by converting "
                            "only other layers (model.approx_layers).")
        e, h = mha.embed_dim, mha.num_heads
        if mha._qkv_same_embed_dim:
            wq, wk, wv = mha.in_proj_weight.detach().chunk(3)
        else:
            wq, wk, wv = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach())
        bq, bk, bv = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.detach().chunk(3)
        self.q_proj, self.k_proj, self.v_proj = _linear(wq, bq), _linear(wk, bk), _linear(wv, bv)
        self.out_proj = _linear(mha.out_proj.weight.detach(),
                                None if mha.out_proj.bias is None else mha.out_proj.bias.detach())
        self.qk, self.av = MatMul(), MatMul()
        self.softmax = nn.Softmax(dim=-1)
        self.embed_dim, self.num_heads, self.head_dim = e, h, e // h
        self.batch_first, self.dropout = mha.batch_first, float(mha.dropout)
        self.train(mha.training)

    def _mask(self, attn_mask, key_padding_mask, is_causal, b, l, s, dtype, device):
        """One additive float mask [b, heads or 1, l, s] (None: no mask), as torch merges its masks."""
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(l, s, dtype=torch.bool, device=device).triu(1)
        mask = None
        if attn_mask is not None:
            m = attn_mask if attn_mask.is_floating_point() else \
                torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill(attn_mask, float("-inf"))
            mask = m.view(1, 1, l, s) if m.dim() == 2 else m.view(b, self.num_heads, l, s)
        if key_padding_mask is not None:
            k = key_padding_mask if key_padding_mask.is_floating_point() else \
                torch.zeros(key_padding_mask.shape, dtype=dtype, device=device).masked_fill(key_padding_mask,
                                                                                           float("-inf"))
            k = k.view(b, 1, 1, s)
            mask = k if mask is None else mask + k
        return mask

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:  # the steps below are written sequence-first, as torch's function is
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        l, b, e = query.shape
        s = key.shape[0]
        h, d = self.num_heads, self.head_dim
        q = self.q_proj(query).reshape(l, b, h, d).permute(1, 2, 0, 3)
        k = self.k_proj(key).reshape(s, b, h, d).permute(1, 2, 0, 3)
        v = self.v_proj(value).reshape(s, b, h, d).permute(1, 2, 0, 3)
        # the float scale after the product: Q is quantized as the projection leaves it
        logits = self.qk(q, k) * (1.0 / math.sqrt(d))
        mask = self._mask(attn_mask, key_padding_mask, is_causal, b, l, s, logits.dtype, logits.device)
        if mask is not None:
            logits = logits + mask
        p = self.softmax(logits)
        p_used = F.dropout(p, self.dropout, self.training) if self.dropout > 0 else p
        out = self.av(p_used, v.transpose(-1, -2))                       # [b, h, l, d]
        out = self.out_proj(out.permute(2, 0, 1, 3).reshape(l, b, e))   # [l, b, e]
        if unbatched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = p.mean(dim=1) if average_attn_weights else p
        return out, weights.squeeze(0) if unbatched else weights
