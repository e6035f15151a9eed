"""Backward family ``sdpa``: the exact attention gradient, computed by F.scaled_dot_product_attention's backward
at the saved inputs (its forward is recomputed inside the vector-Jacobian product; the fused SDPA kernels keep
memory O(N·D)). ``torch.func.vjp`` rather than a nested ``torch.autograd.grad``: AOTAutograd traces it into the
backward graph like any other op."""
from __future__ import annotations

import torch

NAME = "sdpa"


def unsupported(scheme):
    return None


def forward_scheme(scheme):
    return scheme


def saved(q, k, v, attn_mask, kernel_mask, prepared, out, lse):
    return q, k, v, attn_mask


def backward(saved, kv_lens, call, grad_out):
    from ...ops import sdpa_fallback

    q, k, v, attn_mask = saved

    def attention(q, k, v):
        return sdpa_fallback(q, k, v, attn_mask, 0.0, call.scale, call.causal, call.enable_gqa, kv_lens)

    _, vjp = torch.func.vjp(attention, q, k, v)
    return vjp(grad_out)
