"""The demo's model: a plain pre-norm transformer whose attention calls F.scaled_dot_product_attention."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, causal: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, dim // heads, causal
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, causal: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, causal)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DemoTransformer(nn.Module):
    def __init__(self, layers: int = 4, dim: int = 256, heads: int = 4):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.blocks = nn.ModuleList(
            Block(dim, heads, kv_heads=heads if i % 2 == 0 else heads // 2, causal=i % 2 == 1)
            for i in range(layers)
        )

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
