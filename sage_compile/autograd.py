"""The autograd slot of ``sage.attention``: where attention inputs require grad, the 8-bit forward runs inside
``AttentionFunction`` and the gradients come from the backward family that ``SageConfig.backward`` names
(``sage_compile/kernels/backward/``).

It is a ``torch.autograd.Function`` called from sage.attention's CompositeImplicitAutograd decomposition, so
eager autograd and AOTAutograd's joint graph take the same path: the forward's prep is still aten ops that
Inductor fuses into the producers, and the backward family's ops land in the backward graph.
"""
from __future__ import annotations

import torch

from .kernels import backward as backward_kernels


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens, config):
        from .ops import sage_forward

        ctx.save_for_backward(q, k, v, attn_mask, kv_lens)
        ctx.call = (scale, causal, enable_gqa, config.backward)
        return sage_forward(q, k, v, attn_mask, scale, causal, kv_lens, config.scheme)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, attn_mask, kv_lens = ctx.saved_tensors
        scale, causal, enable_gqa, family = ctx.call
        args = backward_kernels.BackwardArgs(q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens)
        dq, dk, dv = backward_kernels.run(family, args, grad_out)
        return dq, dk, dv, None, None, None, None, None, None
