"""Backward family ``sdpa``: the exact attention gradient, computed by F.scaled_dot_product_attention's backward
at the saved inputs (its forward is recomputed inside the vector-Jacobian product; the fused SDPA kernels keep
memory O(N·D)). ``torch.func.vjp`` rather than a nested ``torch.autograd.grad``: AOTAutograd traces it into the
backward graph like any other op."""
from __future__ import annotations

import torch

from . import BackwardArgs

NAME = "sdpa"


def backward(args: BackwardArgs, grad_out: torch.Tensor):
    from ...ops import sdpa_fallback

    def attention(q, k, v):
        return sdpa_fallback(q, k, v, args.attn_mask, 0.0, args.scale, args.causal, args.enable_gqa, args.kv_lens)

    _, vjp = torch.func.vjp(attention, args.q, args.k, args.v)
    return vjp(grad_out)
