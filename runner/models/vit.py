"""A small Vision Transformer for 28x28 and 32x32 images (Dosovitskiy et al. 2021, pre-LayerNorm): the data set's
normalisation, a patch-embedding conv (kernel = stride = patch), a class token and learned position embeddings,
`depth` encoder blocks of x + MHA(LN(x)) and x + MLP(LN(x)) (nn.MultiheadAttention, GELU), a final LayerNorm and a
Linear head on the class token. LayerNorm, GELU and softmax stay in float when the model is quantized (float64,
rounded once to float32, so the CPU and a GPU agree: runner.float64_steps; docs/models.md, Transformers). build_model rewrites each nn.MultiheadAttention into runner.attention's explicit
form, so its projections and (with model.approx_matmuls) its Q.K^T and P.V products are layers of their own."""
from __future__ import annotations

import torch
from torch import nn

from runner.models.common import Normalize


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim),
                                 nn.Dropout(dropout))

    def forward(self, x):
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    def __init__(self, num_classes: int = 10, mean=0.0, std=1.0, in_channels: int = 1, image_size: int = 28,
                 patch: int | None = None, dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: float = 2.0,
                 dropout: float = 0.0):
        super().__init__()
        patch = patch or (7 if image_size % 7 == 0 else 4)  # 28x28: 16 patches; 32x32: 64
        if image_size % patch:
            from runner.errors import UserError
            raise UserError(f"model.patch={patch} does not divide the image size {image_size}.")
        self.input_shape = (in_channels, image_size, image_size)
        self.normalize = Normalize(mean, std)
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        tokens = (image_size // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.layers = nn.Sequential(*(EncoderBlock(dim, heads, mlp_ratio, dropout) for _ in range(depth)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(self.normalize(x)).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embedding
        return self.head(self.ln(self.layers(x))[:, 0])
