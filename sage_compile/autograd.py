"""The autograd slot of ``sage.attention``: where attention inputs require grad, the 8-bit forward runs inside
``AttentionFunction`` and the gradients come from the backward family that ``SageConfig.backward`` names
(``sage_compile/kernels/backward/``).

It is a ``torch.autograd.Function`` called from sage.attention's CompositeImplicitAutograd decomposition, so
eager autograd and AOTAutograd's joint graph take the same path: the forward's prep is still aten ops that
Inductor fuses into the producers, the backward family's prep and ops land in the backward graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import backward as backward_kernels


@dataclass(frozen=True)
class BackwardCall:
    """The forward's call arguments a backward needs (``causal`` as spec.CAUSAL_*)."""

    scale: float
    causal: int
    enable_gqa: bool
    family: str


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, scale, causal, enable_gqa, kv_lens, scheme, family):
        """``scheme``: the forward's numerics — the family's ``forward_scheme`` of the config's."""
        from .ops import quantized_forward

        prepared, kernel_mask, out, lse = quantized_forward(q, k, v, attn_mask, scale, causal, kv_lens, scheme)
        module = backward_kernels.family(family)
        ctx.save_for_backward(*module.saved(q, k, v, attn_mask, kernel_mask, prepared, out, lse), kv_lens)
        ctx.call = BackwardCall(scale, causal, enable_gqa, family)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        *saved, kv_lens = ctx.saved_tensors
        dq, dk, dv = backward_kernels.family(ctx.call.family).backward(saved, kv_lens, ctx.call, grad_out)
        return dq, dk, dv, None, None, None, None, None, None, None
